"""Running one benchmark's `--smoke` (issue #40, item 18), shared by the two smoke test files.

The benchmarks are split over three files, `PLANNING` (predictions and short measured runs) in
`test_benchmarks_smoke.py` and the two halves of `TRAINING` (several real runs each) in
`test_benchmarks_smoke_training.py` and `test_benchmarks_smoke_runs.py`, so that
pytest-xdist's `--dist loadfile` spreads them over its workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))
"""Every benchmark script: `benchmarks/*.py` but the `_` helpers."""
PLANNING = ("accuracy", "context_table", "gpu_step", "long_context", "models", "published", "solve_speed")
TRAINING = ("governor", "bits", "sp", "joint") + ("data", "loss", "remat")
"""The benchmarks that train several runs each: the first four in one test file, the rest in another."""
SUMMARIES = {"governor": "smoke-governor.json"}
"""Benchmarks whose summary is not named after the script (default: `<name>.json`)."""
TIMEOUT_S = 300
"""A hang, not a slow run: each smoke run takes 8-45 s on 2 cores."""


def run_smoke(name: str, out: Path) -> dict:
    """Run `benchmarks/<name>.py --smoke --out <out>` as a user does (its own process, one torch
    thread); assert it exits 0 and writes a CSV and its summary with `"smoke": true`; returns the
    summary."""
    env = os.environ | {"OMP_NUM_THREADS": "1",
                        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, f"benchmarks/{name}.py", "--smoke", "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"benchmarks/{name}.py --smoke exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    summary = json.loads((out / SUMMARIES.get(name, f"{name}.json")).read_text())
    assert summary.get("smoke") is True, summary
    assert list(out.glob("*.csv")), f"benchmarks/{name}.py --smoke wrote no CSV in {sorted(out.iterdir())}"
    return summary
