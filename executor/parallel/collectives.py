"""Collectives whose buffers are freed at a fixed point of the calling thread.

Why: a gloo collective runs on one of ProcessGroupGloo's worker threads, and the work object
that thread runs holds references to the input and output tensors. ``work.wait()`` returns when
the worker marks the work completed, *before* the worker drops its reference
(``ProcessGroupGloo::runLoop``: ``AsyncWork::execute(work)`` notifies the waiter, then
``workInProgress_[i].reset()`` once the worker gets the CPU again). When the caller drops its
own reference first (FSDP2 frees an all-gather's flat output right after copying it out, a
Ulysses all-to-all its send buffer as soon as it returns), the buffer is freed on the worker
thread, later, at a time set by the OS scheduler. On a loaded 2-core machine that was seen as
one rank's MemTracker peak holding FSDP2's root all-gather buffer (16.8 MB) while the next
block's prefetched all-gather buffer (2.9 MB) was already allocated: one block's parameters
more than its peer, in 1 of 6 runs of `benchmarks/sp.py`'s seq 1024 / SP 2 / ZeRO-3 case
with other jobs on the cores.

The helpers below issue the collective, wait for it, and then wait until the backend has let go
of the tensors (their TensorImpl use counts are back to what the caller holds), so that every
buffer is freed where the calling thread drops it: the same place on every rank and every run.
`trainplan.costmodels.step.fsdp` and `trainplan.costmodels.step.ulysses` model those places.
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.distributed as dist

from trainplan.modeling.torch_private import DefaultAllGather, DefaultReduceScatter

RELEASE_TIMEOUT_S = 5.0
"""How long to wait for a backend to drop its references after the collective completed; past
it a warning is given and the caller goes on (the buffer is then freed whenever the backend
lets go, as without these helpers)."""


def wait_released(tensors: tuple[torch.Tensor, ...], held: tuple[int, ...]) -> None:
    """Block (yielding the GIL and the CPU) until each tensor's TensorImpl use count is back to
    `held` (what the caller counted before issuing the collective), i.e. until no collective
    work object references it any more."""
    deadline = None
    # Tensor._use_count exists at run time but not in torch's type stubs
    while any(t._use_count() > n for t, n in zip(tensors, held, strict=False)):  # type: ignore[attr-defined]
        now = time.monotonic()
        if deadline is None:
            deadline = now + RELEASE_TIMEOUT_S
        elif now > deadline:
            warnings.warn("a collective's backend kept its tensors after the collective completed; "
                          "freeing them is left to the backend", RuntimeWarning, stacklevel=3)
            return
        time.sleep(0)


def _synchronous(issue, tensors: tuple[torch.Tensor, ...]) -> None:
    held = tuple(t._use_count() for t in tensors)  # type: ignore[attr-defined]  # (not in torch's stubs)
    work = issue()
    work.wait()
    del work
    wait_released(tensors, held)


def all_to_all_single(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """`torch.distributed.all_to_all_single(out, x, group=group)` (None: the default group),
    returning once the backend has released both tensors (module docstring)."""
    _synchronous(lambda: dist.all_to_all_single(out, x, group=group, async_op=True), (out, x))


class ReleasingAllGather(DefaultAllGather):
    """FSDP2's default all-gather (`torch.distributed.all_gather_single` into a fresh buffer),
    synchronous and returning once the backend has released the buffers (module docstring).
    Installed by `trainplan.executor.parallel.zero.apply_zero` with `FSDPModule.set_custom_all_gather` on CPU
    (gloo). With ``async_op=True`` (explicit async unshards, which `apply_zero` does not use)
    it is the default all-gather."""

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        if async_op:
            return super().__call__(output_tensor, input_tensor, group, async_op=True)
        _synchronous(lambda: dist.all_gather_single(output_tensor, input_tensor, group=group,
                                                    async_op=True), (output_tensor, input_tensor))
        return None


class ReleasingReduceScatter(DefaultReduceScatter):
    """FSDP2's default reduce-scatter, synchronous and returning once the backend has released
    its input and output (and with them its own copies; module docstring). Installed by
    `trainplan.executor.parallel.zero.apply_zero` with `FSDPModule.set_custom_reduce_scatter` on CPU (gloo)."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        if async_op:
            return super().__call__(output_tensor, input_tensor, group, op, async_op=True)
        _synchronous(lambda: dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group,
                                                        async_op=True), (output_tensor, input_tensor))
        return None
