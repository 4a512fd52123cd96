"""`--smoke` of four of the benchmarks that train several real runs each (issue #40, item 18; see
`test_benchmarks_smoke.py`); the other three are in `test_benchmarks_smoke_runs.py`, so that
pytest-xdist's workers share them."""

from __future__ import annotations

import pytest

from tests.integration._benchmark_smoke import TRAINING, run_smoke


@pytest.mark.parametrize("name", TRAINING[:4])
def test_smoke_run_writes_its_summary(name, tmp_path):
    run_smoke(name, tmp_path / "out")
