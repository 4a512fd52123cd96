"""Every benchmark's `--smoke` run (issue #40, item 18): one case, a few steps, the same code path
and output files as the full run, so a later change that breaks a benchmark fails here instead
of at the next `--quick` someone happens to run. This file: the planning benchmarks and the
check that every benchmark is covered; `test_benchmarks_smoke_training.py` the others.

What a smoke run measures (a target met or not) is not asserted: one case of a few steps is no
measurement, and the timed terms depend on the machine's load."""

from __future__ import annotations

import pytest

from tests.integration._benchmark_smoke import BENCHMARKS, PLANNING, ROOT, TRAINING, run_smoke


def test_every_benchmark_has_a_smoke_run_in_the_suite():
    assert len(BENCHMARKS) >= 14, BENCHMARKS
    assert sorted(PLANNING + TRAINING) == BENCHMARKS, "a benchmark is missing from PLANNING or TRAINING"
    for name in BENCHMARKS:
        assert "--smoke" in (ROOT / "benchmarks" / f"{name}.py").read_text(), f"benchmarks/{name}.py has no --smoke"


@pytest.mark.parametrize("name", PLANNING)
def test_smoke_run_writes_its_summary(name, tmp_path):
    run_smoke(name, tmp_path / "out")
