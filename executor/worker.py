"""Multi-process runs: `launch` starts one `python -m trainplan.executor.worker` per device under
torchrun; each worker runs `trainplan.executor.train.run` on its rank.

On several nodes each node calls `launch` with its `Rendezvous` and starts its share,
`decisions.devices / nnodes` processes; the node whose processes include global rank 0 holds
the record (`hosted_rank0`). Logs go to `out/logs/node<N>` then, so that nodes sharing `out`
(a shared filesystem, which resuming from a sharded checkpoint needs) do not mix theirs.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from trainplan.errors import PlanMismatchError
from trainplan.executor.checkpoint import check_resume_plan
from trainplan.executor.data.batches import load_corpus
from trainplan.executor.data.sources import DataOptions, add_data_flags
from trainplan.executor.fit_check import check_fits as check_plan_fits
from trainplan.executor.parallel.launch import Rendezvous, run_torchrun
from trainplan.executor.reporting.trackers import FLAGS, TrackerSpec
from trainplan.executor.train import resolve_device, run
from trainplan.hardware_profiles.threads import THREADS_ENV, threads_per_rank
from trainplan.planner.plan import Plan

LAUNCH_MARGIN_S = 300.0
"""Seconds added to 3x the plan's predicted run time before `launch` stops a job as hung."""

RANK0_FILE = "rank0"
"""Written into a node's log folder by the worker of global rank 0 (`hosted_rank0`)."""


def processes_per_node(devices: int, nnodes: int) -> int:
    """The processes each of `nnodes` nodes starts for a plan of `devices` devices.

    Raises:
        PlanMismatchError: `nnodes` does not divide `devices` (both named, and the divisors)."""
    if nnodes < 1 or devices % nnodes:
        fits = [n for n in range(1, devices + 1) if devices % n == 0]
        raise PlanMismatchError(
            f"the plan uses {devices} device(s), which --nnodes {nnodes} cannot split equally "
            f"(each node starts devices / nnodes processes); give --nnodes one of "
            f"{', '.join(map(str, fits))}, or solve with --devices a multiple of {nnodes}")
    return devices // nnodes


def node_log_dir(out: Path, nodes: Rendezvous | None = None) -> Path:
    """Where `launch` puts this node's torchrun logs: `out/logs`, or `out/logs/node<N>` on
    several nodes."""
    return Path(out) / "logs" if nodes is None else Path(out) / "logs" / f"node{nodes.node_rank}"


def hosted_rank0(out: Path, nodes: Rendezvous | None = None) -> bool:
    """Whether global rank 0 of the last `launch` into `out` ran on this node (always on one
    node; on several, c10d assigns the ranks): that node holds the record in `out`."""
    return nodes is None or (node_log_dir(out, nodes) / RANK0_FILE).exists()


def launch(plan_path: str | Path, out: Path, data: list[str] | None, device: str | None, *,
           resume: bool = False, checkpoint_every: int | None = None,
           stop_after_steps: int | None = None, check_fits: bool = True, threads: int | None = None,
           trackers: TrackerSpec | None = None, nodes: Rendezvous | None = None,
           data_options: DataOptions | None = None, eval_every: int | None = None,
           eval_tokens: int | None = None) -> bool:
    """Run the plan at `plan_path` on `decisions.devices` processes; rank 0 writes
    `out/record.json`. `resume`, `checkpoint_every`, `stop_after_steps`: as in
    `trainplan.executor.train.run`, on every rank. `check_fits`: first check that this node's processes
    and their predicted memory fit this machine (`trainplan.executor.fit_check.check_fits`; each CUDA
    rank then checks its own device); False skips it, also in the workers. `threads`: torch
    threads per rank; None: OMP_NUM_THREADS if set, else the usable cores // this node's ranks
    (`trainplan.hardware_profiles.threads.threads_per_rank`); passed to the workers as OMP_NUM_THREADS
    (torchrun would set it to 1). `trackers`: as in `trainplan.executor.train.run` (rank 0 reports;
    checked here first). `nodes`: this node's part of a multi-node job (every node calls
    `launch` with the same plan and its own `node_rank`); None: one node (`--standalone`).
    `eval_every`, `eval_tokens`: the held-out evaluation's period (steps) and size (tokens), as in
    `trainplan.executor.train.run`; None: its defaults. `data_options`: how the workers read
    `data` (`trainplan.executor.data.sources.DataOptions`: the
    model's tokenizer, a token file's dtype, the text column); None: the defaults.

    SIGINT (Ctrl-C) or SIGTERM to this process stops the job: torchrun passes SIGTERM on to
    the workers, which agree on the step, checkpoint and write the record (within
    `trainplan.executor.parallel.launch.KILL_GRACE_S`, after which they are killed). Returns True when the run
    was interrupted that way, False when it ended by itself.

    Raises:
        PlanMismatchError: with `resume`, the plan differs from `out/plan.json`; `nodes` do not
            divide the plan's devices.
        PlanDoesNotFitError: (with `check_fits`) too many processes or too little memory here.
        WorkerFailedError: a rank failed or the run exceeded 3x its predicted time plus a margin;
            the message names the rank and ends with its stderr.
    """
    plan = Plan.from_json(plan_path)
    local = processes_per_node(plan.decisions.devices, nodes.nnodes if nodes else 1)
    per_rank = threads_per_rank(local, threads)
    if trackers is not None:
        trackers.check()
    if check_fits:
        check_plan_fits(plan, resolve_device(plan, device), processes=local)
    out = Path(out)
    log_dir = node_log_dir(out, nodes)
    log_dir.mkdir(parents=True, exist_ok=True)
    if resume:
        check_resume_plan(plan, out)
    # the workers' plan: on several nodes a copy of this node's own (rank 0 writes out/plan.json)
    workers_plan = out / "plan.json" if nodes is None else log_dir / "plan.json"
    if nodes is not None or not resume:
        plan.to_json(workers_plan)
    args = [str(workers_plan), "--out", str(out)]
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
    if eval_every is not None:
        args += ["--eval-every", str(eval_every)]
    if eval_tokens is not None:
        args += ["--eval-tokens", str(eval_tokens)]
    if trackers is not None:
        args += trackers.argv()
    if data_options is not None:  # --tokenizer, --token-dtype, --text-column
        args += data_options.argv()
    if nodes is not None:
        (log_dir / RANK0_FILE).unlink(missing_ok=True)
        args += ["--rank0-file", str(log_dir / RANK0_FILE)]
    predicted = plan.predictions.step_time_s * plan.decisions.max_steps
    old = _sigterm_as_keyboard_interrupt()
    try:
        run_torchrun("trainplan.executor.worker", args, local, timeout_s=3 * predicted + LAUNCH_MARGIN_S,
                     log_dir=log_dir, env={THREADS_ENV: str(per_rank)}, rendezvous=nodes)
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
    """`python -m trainplan.executor.worker PLAN --out DIR ...`: one rank of `launch`'s job (torchrun sets
    the rank in the environment); runs `trainplan.executor.train.run` on it. Returns the exit status 0."""
    ap = argparse.ArgumentParser(prog="python -m trainplan.executor.worker")
    ap.add_argument("plan")
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", nargs="*")
    add_data_flags(ap)  # --tokenizer, --token-dtype, --text-column
    ap.add_argument("--device")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--checkpoint-every", type=int)
    ap.add_argument("--stop-after-steps", type=int, help="for tests: act as if interrupted then")
    ap.add_argument("--no-fit-check", action="store_true", help="skip trainplan.executor.fit_check")
    ap.add_argument("--eval-every", type=int, help="held-out evaluation period (steps)")
    ap.add_argument("--eval-tokens", type=int, help="held-out tokens per evaluation")
    ap.add_argument("--rank0-file", help="global rank 0 writes its host name here (hosted_rank0)")
    for flag in FLAGS.values():  # --tensorboard DIR, --wandb-project NAME, --trackio-project NAME
        ap.add_argument(flag)
    a = ap.parse_args(argv)
    if a.rank0_file and os.environ.get("RANK") == "0":
        Path(a.rank0_file).write_text(f"{socket.gethostname()}\n")
    plan = Plan.from_json(a.plan)
    data = load_corpus(a.data or None, vocab_size=plan.vocab_size, **DataOptions.from_args(a).kwargs())
    run(plan, data=data, out=a.out, device=a.device, progress=False, resume=a.resume,
        checkpoint_every=a.checkpoint_every, stop_after_steps=a.stop_after_steps,
        check_fits=not a.no_fit_check, trackers=TrackerSpec.from_args(a), eval_every=a.eval_every,
        eval_tokens=a.eval_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
