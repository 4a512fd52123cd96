"""Multi-process runs: `launch` starts one `python -m executor.worker` per device under
torchrun; each worker runs `executor.train.run` on its rank."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from executor.launch import run_torchrun
from planner.plan import Plan

LAUNCH_MARGIN_S = 300.0


def launch(plan_path: str | Path, out: Path, data: list[str] | None, device: str | None) -> None:
    """Run the plan at `plan_path` on `decisions.devices` processes; rank 0 writes
    `out/record.json`.

    Raises:
        WorkerFailedError: a rank failed or the run exceeded 3x its predicted time plus a margin;
            the message names the rank and ends with its stderr.
    """
    plan = Plan.from_json(plan_path)
    out.mkdir(parents=True, exist_ok=True)
    plan.to_json(out / "plan.json")
    args = [str(out / "plan.json"), "--out", str(out)]
    if data:
        args += ["--data", *data]
    if device:
        args += ["--device", device]
    predicted = plan.predictions.step_time_s * plan.decisions.max_steps
    run_torchrun("executor.worker", args, plan.decisions.devices,
                 timeout_s=3 * predicted + LAUNCH_MARGIN_S, log_dir=out / "logs")


def main(argv: list[str] | None = None) -> int:
    from executor.data import load_corpus
    from executor.train import run

    ap = argparse.ArgumentParser(prog="python -m executor.worker")
    ap.add_argument("plan")
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", nargs="*")
    ap.add_argument("--device")
    a = ap.parse_args(argv)
    plan = Plan.from_json(a.plan)
    data = load_corpus(a.data or None, vocab_size=plan.vocab_size)
    run(plan, data=data, out=a.out, device=a.device, progress=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
