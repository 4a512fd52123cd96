"""How `trainplan run` starts a plan's processes: in this process, as one rank of the user's own
launcher, or under torchrun on this node (alone, or one of `--nnodes` nodes at a rendezvous).

- In this process: a one-device plan, and every rank of a job the user launched
  (`torchrun ... -m trainplan run PLAN ...`, or SLURM with torchrun's variables exported: WORLD_SIZE
  set). Such a rank is a worker: it launches nothing, WORLD_SIZE must equal the plan's devices,
  and only global rank 0 writes the record, plan and report; the others print errors only.
- Under torchrun: `--nnodes`, `--node-rank`, `--rdzv-endpoint` and `--rdzv-id` have torchrun's
  names and meanings (c10d rendezvous); each node starts `decisions.devices / nnodes` processes
  (`trainplan.executor.worker.launch`), and the node that got global rank 0 reports.

Nothing here imports torch at import time: `trainplan.planner.cli.main` asks `is_other_rank` before any
command runs.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass

from trainplan.errors import PlanMismatchError, TrainplanError

logger = logging.getLogger(__name__)

ENDPOINT_EXAMPLE = "node0:29500"
ENDED_REASONS = ("budget", "marginal_gain")
"""A run's `stop_reason`s that end it (its budget, the governor's stop): nothing to resume."""


@dataclass(frozen=True)
class EnvRank:
    """This process's place in a job its launcher started (torchrun's RANK and WORLD_SIZE)."""

    rank: int
    world: int


def add_launch_flags(p: argparse.ArgumentParser) -> None:
    """`trainplan run`'s multi-node flags (torchrun's names; None: not given)."""
    g = p.add_argument_group(
        "nodes", "one plan on several machines (torchrun's flags, c10d rendezvous): on each, the same PLAN,\n"
                 "--nnodes and --rdzv-endpoint, and its own --node-rank. Under your own torchrun or SLURM\n"
                 "job (WORLD_SIZE set) leave them out: each rank then trains in place")
    g.add_argument("--nnodes", type=int, metavar="N",
                   help="nodes in the job, each starting devices / N processes (default: 1, this machine)")
    g.add_argument("--node-rank", type=int, metavar="R",
                   help="this node, 0 to N-1, each node its own (default: 0); names its logs, out/logs/nodeR")
    g.add_argument("--rdzv-endpoint", metavar="HOST[:PORT]",
                   help=f"the c10d rendezvous every node joins, e.g. {ENDPOINT_EXAMPLE} (port default "
                        "29400; the node with that address hosts it); needed with --nnodes above 1")
    g.add_argument("--rdzv-id", metavar="ID",
                   help="the job's id at the endpoint, the same on every node (default: torchrun's, none)")


def _whole(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise TrainplanError(f"{name}={text!r} in the environment is not a whole number; it is set by "
                             "torchrun or SLURM (unset it to let `trainplan run` launch)") from None


def env_rank() -> EnvRank | None:
    """This process's rank and world when a launcher started it (WORLD_SIZE set), else None.

    Raises:
        TrainplanError: WORLD_SIZE or RANK is not a whole number, WORLD_SIZE < 1, or RANK is
            missing or outside 0..WORLD_SIZE-1 (both named)."""
    if "WORLD_SIZE" not in os.environ:
        return None
    world = _whole("WORLD_SIZE", os.environ["WORLD_SIZE"])
    if world < 1:
        raise TrainplanError(f"WORLD_SIZE={world} in the environment must be >= 1 (the processes of "
                             "the job torchrun or SLURM started)")
    if "RANK" not in os.environ:
        if world > 1:
            raise TrainplanError(f"WORLD_SIZE={world} in the environment but RANK is not set; start "
                                 "each process with torchrun (which sets both) or export RANK too")
        return EnvRank(0, 1)
    rank = _whole("RANK", os.environ["RANK"])
    if not 0 <= rank < world:
        raise TrainplanError(f"RANK={rank} in the environment is outside 0..{world - 1} "
                             f"(WORLD_SIZE={world})")
    return EnvRank(rank, world)


def is_other_rank() -> bool:
    """Whether this process is a rank other than 0 of a launched job (it then prints errors
    only). Never raises: a malformed RANK is `env_rank`'s to report."""
    try:
        return int(os.environ.get("RANK", "0")) > 0
    except ValueError:
        return False


def check_launch_flags(args) -> EnvRank | None:
    """Check `trainplan run`'s node flags before the plan is read; fill their defaults
    (`args.nnodes` 1, `args.node_rank` 0) and return this process's rank under the user's
    launcher (None: `trainplan run` launches).

    Raises:
        TrainplanError: --nnodes < 1; --node-rank, --rdzv-endpoint or --rdzv-id without
            --nnodes above 1; --node-rank outside 0..nnodes-1; --nnodes above 1
            without --rdzv-endpoint; an endpoint torchrun cannot parse, or port 0; an empty
            --rdzv-id; node flags in a process a launcher started (all named)."""
    given = [f for f, v in (("--nnodes", args.nnodes), ("--node-rank", args.node_rank),
                            ("--rdzv-endpoint", args.rdzv_endpoint), ("--rdzv-id", args.rdzv_id))
             if v is not None]
    env = env_rank()
    if env is not None and given:
        raise TrainplanError(f"{', '.join(given)}: this process is rank {env.rank} of WORLD_SIZE="
                             f"{env.world}, started by torchrun or SLURM, which launched the job; "
                             "leave the node flags out here (they are for `trainplan run` launching)")
    args.nnodes = 1 if args.nnodes is None else args.nnodes
    args.node_rank = 0 if args.node_rank is None else args.node_rank
    if args.nnodes < 1:
        raise TrainplanError(f"--nnodes {args.nnodes}: give the number of nodes, >= 1")
    alone = [f for f in given if f != "--nnodes"]
    if args.nnodes == 1 and alone:
        raise TrainplanError(f"{', '.join(alone)} without --nnodes above 1 would train on this node alone; "
                             "add --nnodes N (the nodes in the job, the same on every node), or leave "
                             f"{'them' if len(alone) > 1 else 'it'} out for one node")
    if not 0 <= args.node_rank < args.nnodes:
        raise TrainplanError(f"--node-rank {args.node_rank} is outside 0..{args.nnodes - 1} "
                             f"(--nnodes {args.nnodes}); give each node its own rank in that range")
    if args.nnodes > 1 and args.rdzv_endpoint is None:
        raise TrainplanError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST[:PORT], the c10d "
                             f"rendezvous every node joins, e.g. {ENDPOINT_EXAMPLE} (an address of node "
                             "0, the same on every node)")
    if args.rdzv_endpoint is not None:
        _check_endpoint(args.rdzv_endpoint)
    if args.rdzv_id is not None and not str(args.rdzv_id).strip():
        raise TrainplanError("--rdzv-id is empty; give the job's id, the same on every node, or leave it out")
    return env


def _check_endpoint(endpoint: str) -> None:
    """torchrun's own parse of `--rdzv-endpoint` (torch.distributed.elastic), and a port it
    can connect to (not 0)."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    bad = ""
    if not endpoint.strip():
        bad = "it is empty"
    else:
        try:
            _, port = parse_rendezvous_endpoint(endpoint, default_port=29400)
        except ValueError as e:
            bad = str(e).rstrip(".")
        else:
            bad = "port 0 is not a port to connect to" if port == 0 else ""
    if bad:
        raise TrainplanError(f"--rdzv-endpoint {endpoint!r}: {bad}; give HOST[:PORT] of node 0, e.g. "
                             f"{ENDPOINT_EXAMPLE}")


def check_world(env: EnvRank | None, devices: int, nnodes: int) -> None:
    """Check that the job's processes are the plan's: WORLD_SIZE under the user's launcher,
    else that `nnodes` divides `devices`.

    Raises:
        PlanMismatchError: WORLD_SIZE differs from the plan's devices; `nnodes` does not
            divide them (the values named)."""
    if env is None:
        from trainplan.executor.worker import processes_per_node

        processes_per_node(devices, nnodes)
        return
    if env.world != devices:
        raise PlanMismatchError(
            f"WORLD_SIZE={env.world} in the environment (the processes torchrun or SLURM started) but "
            f"the plan uses {devices} device(s); start {devices} process(es) in all (torchrun "
            f"--nnodes x --nproc-per-node = {devices}), or solve the plan with --devices {env.world}")


def rendezvous(args):
    """This node's `trainplan.executor.parallel.launch.Rendezvous` from the checked flags (None: one
    node without an endpoint, torchrun `--standalone`)."""
    if args.nnodes == 1 and args.rdzv_endpoint is None:
        return None
    from trainplan.executor.parallel.launch import Rendezvous

    return Rendezvous(nnodes=args.nnodes, node_rank=args.node_rank, endpoint=args.rdzv_endpoint,
                      run_id=args.rdzv_id or "none")


def run_processes(plan, plan_path, data, out, args, env: EnvRank | None, **opts):
    """Run `plan` (`data`: its corpus, `opts`: `trainplan.executor.train.run`'s resume, checkpoint_every,
    trackers) in this process (one device, or this rank `env` of the user's launcher) or under
    torchrun on this node (`launch_plan`; `plan_path` as there).

    Returns (plan, record) where global rank 0 ran (its node, under torchrun), else the exit
    status of this process: 0, or 130 for an interrupted run (rank 0 says how to continue).

    Raises: what `trainplan.executor.train.run` and `launch_plan` raise."""
    if env is None and plan.decisions.devices > 1:
        ran = launch_plan(plan, plan_path, out, args, **opts)
        return 0 if ran is None else ran
    from trainplan.executor.train import run

    record = run(plan, data=data, out=out, device=args.device, progress=not args.quiet, **opts)
    if env is not None and env.rank:
        return 0 if record.stop_reason in ENDED_REASONS else 130
    return plan, record


def launch_plan(plan, plan_path, out, args, **opts):
    """Run `plan` under torchrun on this node (`args`' node flags; `opts` as
    `trainplan.executor.worker.launch` takes them). `plan_path`: its file; None: `plan` differs from the
    solved file (the flags' schedule) and is written for the workers first, to `out/plan.json`
    on one node, else into this node's log folder (nodes sharing `out` do not write one file).

    Returns (plan, record) read from `out` when this node ran global rank 0, else None (after a
    line on stdout saying so).

    Raises:
        KeyboardInterrupt: the job was interrupted on a node without rank 0 (exit 130; the record
            is rank 0's node's).
        what `trainplan.executor.worker.launch` raises (WorkerFailedError names the failed rank)."""
    from trainplan.executor.data.sources import DataOptions
    from trainplan.executor.reporting.report import load_run
    from trainplan.executor.worker import hosted_rank0, launch, node_log_dir, processes_per_node

    nodes = rendezvous(args)
    if plan_path is None:
        plan_path = out / "plan.json" if nodes is None else node_log_dir(out, nodes) / "plan.json"
        plan_path.parent.mkdir(parents=True, exist_ok=True)
        plan.to_json(plan_path)
    local = processes_per_node(plan.decisions.devices, args.nnodes)
    where = "" if nodes is None else f" (node {nodes.node_rank} of {nodes.nnodes}, rendezvous {nodes.endpoint})"
    logger.info("launching %d processes under torchrun%s; logs in %s", local, where, node_log_dir(out, nodes))
    interrupted = launch(plan_path, out, args.data, args.device, nodes=nodes,
                         data_options=DataOptions.from_args(args), **opts)
    if hosted_rank0(out, nodes):
        return load_run(out)
    if interrupted:
        raise KeyboardInterrupt
    print(f"node {args.node_rank} of {args.nnodes}: its {local} process(es) finished; global rank 0 ran on "
          "another node, which writes the record and report")
    return None
