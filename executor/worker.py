"""Multi-process runs: `launch` starts one `python -m executor.worker` per device under
torchrun; each worker runs `executor.train.run` on its rank."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from executor.checkpoint import check_resume_plan
from executor.data.batches import load_corpus
from executor.fit_check import check_fits as check_plan_fits
from executor.parallel.launch import run_torchrun
from executor.reporting.trackers import FLAGS, TrackerSpec
from executor.train import resolve_device, run
from hardware_profiles.threads import THREADS_ENV, threads_per_rank
from planner.plan import Plan

LAUNCH_MARGIN_S = 300.0
"""Seconds added to 3x the plan's predicted run time before `launch` stops a job as hung."""


def launch(plan_path: str | Path, out: Path, data: list[str] | None, device: str | None, *,
           resume: bool = False, checkpoint_every: int | None = None,
           stop_after_steps: int | None = None, check_fits: bool = True, threads: int | None = None,
           trackers: TrackerSpec | None = None) -> bool:
    """Run the plan at `plan_path` on `decisions.devices` processes; rank 0 writes
    `out/record.json`. `resume`, `checkpoint_every`, `stop_after_steps`: as in
    `executor.train.run`, on every rank. `check_fits`: first check that the processes and
    their predicted memory fit this machine (`executor.fit_check.check_fits`; each CUDA rank
    then checks its own device); False skips it, also in the workers. `threads`: torch threads
    per rank; None: OMP_NUM_THREADS if set, else the usable cores // ranks
    (`hardware_profiles.threads.threads_per_rank`); passed to the workers as OMP_NUM_THREADS
    (torchrun would set it to 1). `trackers`: as in `executor.train.run` (rank 0 reports;
    checked here first).

    SIGINT (Ctrl-C) or SIGTERM to this process stops the job: torchrun passes SIGTERM on to
    the workers, which agree on the step, checkpoint and write the record (within
    `executor.parallel.launch.KILL_GRACE_S`, after which they are killed). Returns True when the run
    was interrupted that way, False when it ended by itself.

    Raises:
        PlanMismatchError: with `resume`, the plan differs from `out/plan.json`.
        PlanDoesNotFitError: (with `check_fits`) too many processes or too little memory here.
        WorkerFailedError: a rank failed or the run exceeded 3x its predicted time plus a margin;
            the message names the rank and ends with its stderr.
    """
    plan = Plan.from_json(plan_path)
    per_rank = threads_per_rank(plan.decisions.devices, threads)
    if trackers is not None:
        trackers.check()
    if check_fits:
        check_plan_fits(plan, resolve_device(plan, device))
    out.mkdir(parents=True, exist_ok=True)
    if resume:
        check_resume_plan(plan, out)
    else:
        plan.to_json(out / "plan.json")
    args = [str(out / "plan.json"), "--out", str(out)]
    if data:
        args += ["--data", *data]
    if device:
        args += ["--device", device]
    if resume:
        args.append("--resume")
    if checkpoint_every is not None:
        args += ["--checkpoint-every", str(checkpoint_every)]
    if stop_after_steps is not None:
        args += ["--stop-after-steps", str(stop_after_steps)]
    if not check_fits:
        args.append("--no-fit-check")
    if trackers is not None:
        args += trackers.argv()
    predicted = plan.predictions.step_time_s * plan.decisions.max_steps
    old = _sigterm_as_keyboard_interrupt()
    try:
        run_torchrun("executor.worker", args, plan.decisions.devices,
                     timeout_s=3 * predicted + LAUNCH_MARGIN_S, log_dir=out / "logs",
                     env={THREADS_ENV: str(per_rank)})
    except KeyboardInterrupt:  # run_torchrun has stopped the job (workers checkpoint on SIGTERM)
        return True
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    return False


def _sigterm_as_keyboard_interrupt():
    """SIGTERM raises KeyboardInterrupt (so that `run_torchrun` stops the job, which it does
    for KeyboardInterrupt) instead of killing this process and orphaning torchrun. Returns
    the old handler (None off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    """`python -m executor.worker PLAN --out DIR ...`: one rank of `launch`'s job (torchrun sets
    the rank in the environment); runs `executor.train.run` on it. Returns the exit status 0."""
    ap = argparse.ArgumentParser(prog="python -m executor.worker")
    ap.add_argument("plan")
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", nargs="*")
    ap.add_argument("--device")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--checkpoint-every", type=int)
    ap.add_argument("--stop-after-steps", type=int, help="for tests: act as if interrupted then")
    ap.add_argument("--no-fit-check", action="store_true", help="skip executor.fit_check")
    for flag in FLAGS.values():  # --tensorboard DIR, --wandb-project NAME, --trackio-project NAME
        ap.add_argument(flag)
    a = ap.parse_args(argv)
    plan = Plan.from_json(a.plan)
    data = load_corpus(a.data or None, vocab_size=plan.vocab_size)
    run(plan, data=data, out=a.out, device=a.device, progress=False, resume=a.resume,
        checkpoint_every=a.checkpoint_every, stop_after_steps=a.stop_after_steps,
        check_fits=not a.no_fit_check, trackers=TrackerSpec.from_args(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
