"""Processes: joining torchrun's process group, and launching torchrun jobs that cannot hang.

A worker module run under `run_torchrun` calls `init_distributed(device)` first; the parent sees a
failed or hung job as `WorkerFailedError` naming the rank, its exit code and its last stderr lines.
One node (`--standalone`), or one of several joined by a c10d rendezvous (`Rendezvous`: torchrun's
`--nnodes`, `--node-rank`, `--rdzv-endpoint`, `--rdzv-id`; each node runs this on its own).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from trainplan.errors import TrainplanError

REPO_ROOT = Path(sys.modules["trainplan"].__file__ or ".").parent.parent
"""The folder that holds the `trainplan` package (a checkout's root, or site-packages), prepended to
the workers' PYTHONPATH so that ``-m trainplan...`` (and, in a checkout, ``-m tests...``) resolve.
Taken from the package as imported, not from this file's resolved path: in a checkout
`trainplan/executor` is a link to the top-level `executor/` folder."""

STDERR_TAIL_LINES = 20
"""Lines of the failed rank's stderr quoted in a WorkerFailedError."""

KILL_GRACE_S = 10.0
"""After SIGTERM, seconds to wait for torchrun to stop its workers before SIGKILL."""


RDZV_JOIN_TIMEOUT_S = 600.0
"""Seconds a node waits at the rendezvous for the others (torchrun's c10d `join_timeout`
default); `run_torchrun` adds it to a multi-node job's time limit, so that a node that never
comes fails as torchrun's rendezvous timeout, not as a hang."""


@dataclass(frozen=True)
class Rendezvous:
    """This node's part in a multi-node torchrun job (torchrun's flags, c10d rendezvous).

    nnodes: nodes in the job (each runs `run_torchrun` with the same `nproc`). node_rank: this
    node, 0 to nnodes - 1: names its logs (c10d assigns the global ranks in the order it
    chooses; torchrun's `--node-rank` is read by the static backend only). endpoint:
    `HOST[:PORT]` of the c10d store every node joins (port default 29400; the node whose
    address it is hosts the store). run_id: the job's id at that endpoint (torchrun's default
    "none"). join_timeout_s: seconds to wait for all nodes (`RDZV_JOIN_TIMEOUT_S`).
    """

    nnodes: int
    node_rank: int
    endpoint: str
    run_id: str = "none"
    join_timeout_s: float = RDZV_JOIN_TIMEOUT_S

    def torchrun_args(self) -> list[str]:
        """torchrun's flags for this node (in place of `--standalone`)."""
        return [f"--nnodes={self.nnodes}", f"--node-rank={self.node_rank}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.run_id}",
                f"--rdzv-conf=join_timeout={self.join_timeout_s:g}"]


class WorkerFailedError(TrainplanError):
    """A torchrun job exited non-zero or ran past its time limit.

    Attributes: ``rank`` (global rank of the first failed worker, None when unknown, e.g. on
    timeout), ``exit_code`` (that worker's exit code; negative: killed by that signal; None on
    timeout), ``log_dir`` (where torchrun's and the per-rank logs are).
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        exit_code: int | None = None,
        log_dir: Path | None = None,
    ):
        super().__init__(message)
        self.rank = rank
        self.exit_code = exit_code
        self.log_dir = log_dir


# --------------------------------------------------------------------------------------------
# In the worker
# --------------------------------------------------------------------------------------------


def init_distributed(device: torch.device, timeout_s: float = 120) -> tuple[int, int]:
    """Join the process group torchrun describes in the environment; return ``(rank, world_size)``.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. Backend from the device type:
    gloo for cpu; for an accelerator its default backend (nccl for cuda, ROCm included) for device
    tensors plus gloo for cpu tensors, and the process's current device is set to LOCAL_RANK.
    ``timeout_s`` bounds every collective (a peer that died surfaces as an error, not a hang).
    With WORLD_SIZE unset or 1 no process group is created and ``(0, 1)`` is returned. Idempotent.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type != "cpu":
        getattr(torch, device.type).set_device(local_rank)
    if world == 1:
        return 0, 1
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise TrainplanError(
            f"WORLD_SIZE={world} but {', '.join(missing)} not set; launch with torchrun "
            "(trainplan.executor.parallel.launch.run_torchrun)"
        )
    backend = dist.Backend.default_device_backend_map.get(device.type)
    if backend is None:
        raise TrainplanError(
            f"no distributed backend for device type {device.type!r}; known: "
            f"{sorted(dist.Backend.default_device_backend_map)}"
        )
    if device.type != "cpu":
        backend = f"cpu:gloo,{device.type}:{backend}"
    rank = int(os.environ["RANK"])
    dist.init_process_group(
        backend=backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    atexit.register(destroy_at_exit)
    return rank, world


def destroy_at_exit() -> None:
    """Destroy the default process group, if still initialised, while the interpreter is alive.

    Registered with `atexit` by `init_distributed`. A gloo group left to interpreter finalization
    can abort the process (SIGABRT, "terminate called without an active exception": its worker
    threads still hold tensors; pytorch/pytorch#190489). Skipped after an uncaught exception
    (``sys.last_value`` set), where peers may sit in a collective and destroying could hang, as
    torchtitan does (pytorch/torchtitan#1342)."""
    if dist.is_initialized() and getattr(sys, "last_value", None) is None:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# In the parent
# --------------------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc; empty elsewhere)."""
    kids = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            stat = entry.read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...; comm may contain spaces and parentheses
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            kids.append(int(entry.parent.name))
    return kids


def _killpg(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _stop(proc: subprocess.Popen) -> None:
    """Stop torchrun and its workers: SIGTERM torchrun's group (it then stops its workers), then
    SIGKILL torchrun's group and each worker's own session (torchrun starts workers with
    start_new_session, so they are not in torchrun's group)."""
    workers = _children(proc.pid)
    _killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=KILL_GRACE_S)
    for pgid in [proc.pid, *workers]:
        _killpg(pgid, signal.SIGKILL)
    proc.wait()


def _tail(path: Path, n: int = STDERR_TAIL_LINES) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    return "\n".join(lines[-n:]) if lines else "(empty)"


def _rank_stderr(run_dirs: list[Path], local_rank: int) -> Path | None:
    """stderr.log of ``local_rank`` in the newest attempt of the newest run directory."""
    for run_dir in sorted(run_dirs, key=lambda p: p.stat().st_mtime, reverse=True):
        attempts = sorted(run_dir.glob("attempt_*"), key=lambda p: int(p.name.split("_")[1]))
        for attempt in reversed(attempts):
            path = attempt / str(local_rank) / "stderr.log"
            if path.exists():
                return path
    return None


_ROOT_CAUSE = re.compile(
    r"Root Cause.*?rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\).*?exitcode\s*:\s*(-?\d+)", re.S
)


_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\).*?exitcode\s*:\s*(-?\d+)", re.S)

_SECONDARY = ("DistBackendError", "Connection closed by peer", "Connection reset by peer",
              "Broken pipe", "ProcessGroupGloo", "ProcessGroupNCCL", "NCCL communicator")
"""Marks of a rank that failed because another one died first (its collective lost a peer)."""


def _rank_exit(m: re.Match) -> tuple[int, int, int]:
    """(rank, local rank, exit code) of a failure line matched by `_ROOT_CAUSE` or `_FAILURE`."""
    rank, local_rank, code = (int(g) for g in m.groups())
    return rank, local_rank, code


def first_cause(summary: str, run_dirs: list[Path]) -> tuple[int, int, int] | None:
    """(rank, local rank, exit code) of the failure that caused the others: torchrun's "Root
    Cause" (the first failure its polling observed), unless that rank's stderr shows only a lost
    peer in a collective while another failed rank's does not (ranks that fail in the same
    second are observed in polling order, not in the order they failed)."""
    root = _ROOT_CAUSE.search(summary)
    if root is None:
        return None
    first = _rank_exit(root)

    def secondary(local_rank: int) -> bool:
        path = _rank_stderr(run_dirs, local_rank)
        text = _tail(path, 40) if path else ""
        return any(m in text for m in _SECONDARY)

    if not secondary(first[1]):
        return first
    failures = {_rank_exit(m) for m in _FAILURE.finditer(summary)}
    primary = sorted(f for f in failures if f != first and not secondary(f[1]))
    return primary[0] if primary else first


_RDZV_ERROR = re.compile(r"(Rendezvous\w*Error)\b:?[ \t]*([^\n]*)")


def _rendezvous_failed(rdzv: Rendezvous, summary: str, torchrun_log: Path) -> str:
    """The message of a node whose torchrun failed at the c10d rendezvous (its last error named)."""
    name, detail = _RDZV_ERROR.findall(summary)[-1]
    why = (f"not all {rdzv.nnodes} nodes joined within {rdzv.join_timeout_s:g} s; start `trainplan run` "
           "on every node with the same --nnodes, --rdzv-endpoint and --rdzv-id, each with its own --node-rank"
           if "Timeout" in name else
           f"check that {rdzv.endpoint} is node 0's address, reachable from this node, and the port free there")
    return (f"node {rdzv.node_rank} of {rdzv.nnodes}: the c10d rendezvous at {rdzv.endpoint} failed "
            f"({name}{': ' + detail.strip() if detail.strip() else ''}): {why}; torchrun's log: {torchrun_log}")


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            return str(code)
    return str(code)


def run_torchrun(
    module: str,
    args: list[str],
    nproc: int,
    *,
    timeout_s: float,
    log_dir: Path,
    env: dict[str, str] | None = None,
    rendezvous: Rendezvous | None = None,
) -> None:
    """Run ``python -m torch.distributed.run --standalone --nproc-per-node N -m module args...``.

    With ``rendezvous``, this node's part of a multi-node job instead of ``--standalone``:
    ``nproc`` processes here, ``nnodes x nproc`` in all, and ``timeout_s`` plus the rendezvous'
    join timeout. Blocks until the job ends or ``timeout_s`` (wall clock) passes. Logs: torchrun's own output
    (with every worker's output teed in, prefixed ``[rankN]:``) goes to ``log_dir/torchrun-*.log``;
    each rank's stdout/stderr to ``log_dir/<run id>/attempt_0/<local rank>/std{out,err}.log``.
    The repository root is prepended to the workers' PYTHONPATH; ``env`` adds variables.

    Raises WorkerFailedError on a non-zero exit (naming the first failed rank from torchrun's
    "Root Cause" summary, its exit code and the last lines of its stderr) or on timeout (the whole
    job is killed: torchrun's process group and each worker's session; the message quotes the
    last stderr lines of every rank). Nothing is left running when it returns or raises.
    """
    if nproc < 1:
        raise TrainplanError(f"nproc must be >= 1, got {nproc}")
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    before = set(log_dir.iterdir())
    nodes = ["--standalone"] if rendezvous is None else rendezvous.torchrun_args()
    if rendezvous is not None:
        timeout_s += rendezvous.join_timeout_s
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        *nodes, f"--nproc-per-node={nproc}",
        f"--log-dir={log_dir}", "--redirects=3", "--tee=3",
        "-m", module, *map(str, args),
    ]  # fmt: skip
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), child_env.get("PYTHONPATH", "")) if p
    )
    child_env.update(env or {})
    torchrun_log = log_dir / f"torchrun-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    with open(torchrun_log, "ab") as out:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            env=child_env, start_new_session=True,
        )  # fmt: skip
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
            _stop(proc)
        except BaseException:  # KeyboardInterrupt and the like: leave nothing behind
            _stop(proc)
            raise
    if code == 0:
        return

    run_dirs = [p for p in set(log_dir.iterdir()) - before if p.is_dir()]
    here = "" if rendezvous is None else f" on node {rendezvous.node_rank} of {rendezvous.nnodes}"
    if code is None:
        tails = []
        for r in range(nproc):
            path = _rank_stderr(run_dirs, r)
            tail = _tail(path, 5) if path else "(no log)"
            tails.append(f"--- rank {r} stderr ({path}):\n{tail}")
        raise WorkerFailedError(
            f"torchrun -m {module} ({nproc} processes{here}) timed out after {timeout_s:g} s and was "
            f"killed; logs in {log_dir}\n" + "\n".join(tails),
            log_dir=log_dir,
        )
    summary = _tail(torchrun_log, 200)
    cause = first_cause(summary, run_dirs)
    if cause is None and rendezvous is not None and _RDZV_ERROR.search(summary):
        raise WorkerFailedError(_rendezvous_failed(rendezvous, summary, torchrun_log), exit_code=code,
                                log_dir=log_dir)
    if cause is None:  # torchrun itself failed (bad arguments, rendezvous, ...)
        raise WorkerFailedError(
            f"torchrun -m {module}{here} exited with code {_describe_exit(code)} before naming a failed "
            f"rank; last lines of {torchrun_log}:\n{_tail(torchrun_log)}",
            exit_code=code,
            log_dir=log_dir,
        )
    rank, local_rank, rank_code = cause
    path = _rank_stderr(run_dirs, local_rank)
    tail = _tail(path) if path else f"(no per-rank log; see {torchrun_log})"
    if rendezvous is not None and any(m in tail for m in _SECONDARY):
        here += (" after losing a peer: a rank on another node probably failed first (that node's "
                 "error names it)")
    raise WorkerFailedError(
        f"rank {rank} of torchrun -m {module}{here} failed with exit code {_describe_exit(rank_code)}; "
        f"last lines of its stderr ({path}):\n{tail}",
        rank=rank,
        exit_code=rank_code,
        log_dir=log_dir,
    )
