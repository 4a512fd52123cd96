"""Every benchmark's `--smoke` run (issue #40, item 18): one case, a few steps, the same code path
and output files as the full run, so a later change that breaks a benchmark fails here instead
of at the next `--quick` someone happens to run.

Each benchmark runs in its own process (as a user runs it), with one torch thread, into a scratch
`--out`; it must exit 0 and write its JSON summary with `"smoke": true` and at least one CSV.
What a smoke run measures (a target met or not) is not asserted: one case of a few steps is no
measurement, and the timed terms depend on the machine's load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))
SUMMARIES = {"published": "published.json", "models": "models.json"}
"""Benchmarks whose summary is not named after the script (default: `<name>.json`)."""
TIMEOUT_S = 240
"""A hang, not a slow run: each smoke run takes 5-25 s on 2 idle cores."""


def test_every_benchmark_is_listed():
    assert len(BENCHMARKS) >= 14, BENCHMARKS
    for name in BENCHMARKS:
        assert "--smoke" in (ROOT / "benchmarks" / f"{name}.py").read_text(), f"benchmarks/{name}.py has no --smoke"


@pytest.mark.parametrize("name", BENCHMARKS)
def test_smoke_run_writes_its_summary(name, tmp_path):
    out = tmp_path / "out"
    env = os.environ | {"OMP_NUM_THREADS": "1",
                        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, f"benchmarks/{name}.py", "--smoke", "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"benchmarks/{name}.py --smoke exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    summary = json.loads((out / SUMMARIES.get(name, f"{name}.json")).read_text())
    assert summary.get("smoke") is True, summary
    assert list(out.glob("*.csv")), f"benchmarks/{name}.py --smoke wrote no CSV in {sorted(out.iterdir())}"
