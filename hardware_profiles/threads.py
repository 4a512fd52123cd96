"""torch's CPU threads per process: the usable cores shared among a run's ranks, unless the user set them.

One rule for the run and for the profile that predicts it: `trainplan.executor.train.run` sets torch's
intra-op threads of each rank to `threads_per_rank(ranks, threads)`, `trainplan.executor.worker.launch`
passes that count to its torchrun workers as OMP_NUM_THREADS, and `trainplan.hardware_profiles.cpu`
measures and caches the `cpu` profile at `threads_per_rank(1)`, the count a one-process run uses.

The count is, in order: an explicit `threads` (a `threads=` argument), else OMP_NUM_THREADS when
set (the user's choice; torchrun sets it to 1 for its workers when it is unset, which is why
`launch` sets it itself), else the usable cores // ranks, at least 1. Usable cores: the CPUs this
process may run on (`os.sched_getaffinity`, else `os.cpu_count()`), capped by a cgroup CPU quota.
More threads than cores make OpenMP's workers wait on each other: on a loaded 2-core machine a
2-thread step of tiny-llama ran 150x slower than at one thread (issue 24).

torch is imported inside `torch_threads`, so importing this module stays cheap.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from trainplan.errors import TrainplanError

THREADS_ENV = "OMP_NUM_THREADS"
"""The environment variable a user sets the threads per process with (OpenMP's; torch reads it
at start-up too)."""


def _cgroup_cpu_quota() -> int | None:
    """Whole CPUs of this process's cgroup CPU quota (v2 cpu.max, v1 cfs quota/period), rounded
    up; None without a quota."""
    candidates = (("/sys/fs/cgroup/cpu.max", None),
                  ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"))
    for path, period_path in candidates:
        try:
            fields = Path(path).read_text().split()
            if period_path is not None:
                fields.append(Path(period_path).read_text().strip())
            quota, period = int(fields[0]), int(fields[1])
        except (OSError, ValueError, IndexError):
            continue
        if quota > 0 and period > 0:
            return max(1, math.ceil(quota / period))
    return None


def usable_cores() -> int:
    """CPUs this process may run on: its affinity set (`os.sched_getaffinity(0)`; `os.cpu_count()`
    where there is none), capped by the cgroup CPU quota; at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(cores, quota) if quota else cores)


def _whole(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TrainplanError(f"{name}={value!r} must be a whole number of threads >= 1")
    return value


def user_threads() -> int | None:
    """The threads per process the user set with OMP_NUM_THREADS, None when it is unset or empty.
    OpenMP's nested form ("4,2") gives its first level.

    Raises:
        TrainplanError: OMP_NUM_THREADS is set to something other than a whole number >= 1.
    """
    raw = os.environ.get(THREADS_ENV, "").strip()
    if not raw:
        return None
    first = raw.split(",")[0].strip()
    if not first.isdigit() or int(first) < 1:
        raise TrainplanError(f"{THREADS_ENV}={raw!r} must be a whole number of threads >= 1 "
                             "(or unset: each rank then gets the usable cores // ranks)")
    return int(first)


def threads_per_rank(ranks: int = 1, threads: int | None = None) -> int:
    """torch's intra-op threads for each of `ranks` processes of a run on this machine: `threads`
    when given, else OMP_NUM_THREADS when set, else `usable_cores() // ranks`, at least 1.

    Raises:
        TrainplanError: `ranks` or `threads` is not a whole number >= 1, or OMP_NUM_THREADS is
            set to something else (`user_threads`).
    """
    ranks = _whole("ranks", ranks)
    if threads is not None:
        return _whole("threads", threads)
    return user_threads() or max(1, usable_cores() // ranks)


@contextmanager
def torch_threads(n: int) -> Iterator[int]:
    """torch's intra-op threads set to `n` inside the block (yields `n`), restored after."""
    import torch

    n = _whole("threads", n)
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield n
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
