"""Activation offload: tensors autograd saves for the backward kept in host memory between the forward and the backward.

The activation checkpoint offload to CPU memory of ALST (Bekman et al. 2025, "Arctic Long
Sequence Training", arXiv:2506.13996): in a long-context step the saved block inputs of
activation checkpointing dominate device memory, so each goes to host (CPU) memory in the forward
and comes back for the backward. Built on `torch.autograd.graph.saved_tensors_hooks`, the
mechanism of `trainplan.modeling.activation_compression` (pack when autograd saves a tensor, unpack when
the backward reads it) and of torch's `torch.autograd.graph.save_on_cpu`, extended here with a
side stream, prefetch and deduplication. With checkpointed blocks, offload outside the
checkpoint: `offload_block` says why, and what the hooks then see (the block inputs only).

- Pack: on an accelerator (CUDA or ROCm, device-agnostic through `torch.accelerator`) the tensor
  is copied device->host into a pinned buffer, non-blocking, on a side stream that first waits for
  the current one; an event marks the copy's end. On the CPU (the device is the host) it is
  copied into a separate host tensor synchronously, so that the same mechanism runs in tests.
- Unpack: the copy back host->device is issued on the side stream after the pack's event and the
  current stream waits on it; on the CPU a synchronous copy.
- Prefetch: items packed into one `OffloadStats` are numbered in pack order; when item k is
  unpacked, the copy back of the latest earlier item not yet fetched (k-1, ...) starts on the side
  stream, since a backward runs the blocks in reverse order; on the CPU this is bookkeeping only.
- Layout: the copy is of the storage span the tensor covers, restored with `as_strided`, so shape,
  strides (transposes, expands) and values come back bit-exact; a view with gaps whose span
  exceeds its elements is copied compactly and restored into `torch.empty_strided` of its strides.
- Deduplication: a tensor saved by several backward nodes (same storage, offset, shape, stride,
  dtype and version) is offloaded once, as `trainplan.modeling.activation_compression` packs once.

Left on the device: parameters, their views and autocast casts (weights, not activations),
non-floating tensors, tensors of fewer than `min_numel` elements, tensor subclasses (DTensor,
fake tensors) and non-strided layouts.
"""

from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from trainplan.errors import TrainplanError
from trainplan.modeling.activation_compression import is_weight

_LOCK = threading.Lock()  # pack runs in the forward's thread, unpack and release in autograd's


@dataclass
class OffloadStats:
    """What one step offloaded; share one object between the blocks of a model so that prefetch
    runs across blocks and the peak is the model's. Bytes are host bytes (storage span copied)."""

    offloaded_bytes: int = 0
    """Bytes copied to host in the forward since the last `reset`."""
    host_peak_bytes: int = 0
    """Most bytes held on host at once since the last `reset`."""
    tensors: int = 0
    """Tensors offloaded since the last `reset` (one per distinct saved tensor)."""
    host_bytes: int = 0
    """Bytes held on host now: an item's bytes are released when autograd frees it (after the
    backward node that unpacked it ran, or with its graph)."""
    prefetched: int = 0
    """Items whose copy back was started ahead of their unpack since the last `reset`."""
    pending: dict = field(default_factory=dict, repr=False, compare=False)
    """Prefetch bookkeeping: pack index -> weak reference, for the live items whose copy back has
    not started, in pack order."""
    packs: int = field(default=0, repr=False, compare=False)
    """Prefetch bookkeeping: items ever packed into these stats (the next pack index)."""

    def reset(self) -> None:
        """Start a step: zero the counters; the peak restarts at the bytes still on host."""
        with _LOCK:
            self.offloaded_bytes = self.tensors = self.prefetched = 0
            self.host_peak_bytes = self.host_bytes


class OffloadedTensor:
    """A saved tensor in host memory: `host` (1-D, pinned on an accelerator) holds the storage span
    from the tensor's first element (`compact` False) or its elements in row-major order (`compact`
    True); `shape`, `stride`, `dtype`, `device` restore it; `event` marks the end of the copy to
    host (None on the CPU); `fetched` says the copy back was started (`ready`, with `ready_event`,
    holds a prefetched copy until its unpack)."""

    __slots__ = ("host", "compact", "shape", "stride", "dtype", "device", "event", "source", "index",
                 "fetched", "ready", "ready_event", "last", "__weakref__")

    def __init__(self, host, compact, t: torch.Tensor, event, source, index: int):
        self.host, self.compact, self.event, self.source, self.index = host, compact, event, source, index
        self.shape, self.stride, self.dtype, self.device = tuple(t.shape), tuple(t.stride()), t.dtype, t.device
        self.fetched, self.ready, self.ready_event = False, None, None
        self.last: weakref.ref | None = None  # the tensor the last unpack returned, while it lives

    @property
    def nbytes(self) -> int:
        """Host bytes of this item."""
        return self.host.numel() * self.host.element_size()


def _span(t: torch.Tensor) -> int:
    """Elements of storage from the tensor's first element to its last (strides are >= 0)."""
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))


def _release(stats: OffloadStats, nbytes: int, index: int) -> None:
    """An item freed by autograd: its host bytes are gone and it will not be fetched."""
    with _LOCK:
        stats.host_bytes -= nbytes
        stats.pending.pop(index, None)


class offload_saved_activations(torch.autograd.graph.saved_tensors_hooks):  # lower case, as save_on_cpu
    """Context manager: the tensors autograd saves inside it are kept in host memory until the
    backward reads them. Use around the forward only; the backward unpacks wherever it runs.

    `skip_ids`: `id()`s of tensors to leave alone besides `nn.Parameter`s (and their views and
    casts); `min_numel`: smaller tensors stay on the device; `stats`: the counters to update (a
    fresh `OffloadStats` when None; `with` gives it, as does `.stats`); `prefetch`: start the copy back of the
    previous item when one is unpacked. Composition with `torch.utils.checkpoint` and
    `trainplan.modeling.activation_compression`: the innermost saved-tensor hooks win (see `offload_block`).

    Raises:
        TrainplanError: `min_numel` negative.
    """

    def __init__(self, *, skip_ids: frozenset[int] = frozenset(), min_numel: int = 1024,
                 stats: OffloadStats | None = None, prefetch: bool = True):
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise TrainplanError(f"min_numel={min_numel!r}: give a number of elements >= 0")
        self.skip_ids, self.min_numel, self.prefetch = frozenset(skip_ids), min_numel, prefetch
        self.stats = stats if stats is not None else OffloadStats()
        self._seen: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        super().__init__(self.pack, self.unpack)

    def __enter__(self) -> OffloadStats:  # type: ignore[override]
        """Install the hooks; `with offload_saved_activations() as stats:` gives the counters."""
        super().__enter__()
        return self.stats

    def _skip(self, t: torch.Tensor) -> bool:
        return type(t) is not torch.Tensor or t.layout != torch.strided \
            or t.device.type == "meta" or not t.is_floating_point() or t.numel() == 0 \
            or t.numel() < self.min_numel or is_weight(t, self.skip_ids)

    def pack(self, t: torch.Tensor):
        """Autograd's pack hook: `t` itself if left alone, else its `OffloadedTensor` (one per
        distinct saved tensor)."""
        if self._skip(t):
            return t
        ref = StorageWeakRef(t.untyped_storage())  # reserves the storage's address while the item lives
        key = (ref.cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t._version, t.dtype)
        hit = self._seen.get(key)
        if hit is not None:
            return hit
        span = _span(t)
        compact = span > t.numel()  # a view with gaps: copy its elements only
        n = t.numel() if compact else span
        with torch.no_grad():
            src = t.detach()
            src = src.reshape(-1) if compact else src.as_strided((n,), (1,), src.storage_offset())
            if t.device.type == "cpu":
                host = torch.empty(n, dtype=t.dtype)
                host.copy_(src)
                event = None
            else:
                side = _side_stream(t.device)
                side.wait_stream(torch.accelerator.current_stream(t.device))
                host = torch.empty(n, dtype=t.dtype, pin_memory=True)
                with side:
                    if compact:  # made on the current stream, read on the side one: reshape is a copy
                        src.record_stream(side)
                    host.copy_(src, non_blocking=True)
                    event = side.record_event()
                t.record_stream(side)  # the source's memory is not reused before the copy is done
        stats = self.stats
        with _LOCK:
            packed = OffloadedTensor(host, compact, t, event, ref, stats.packs)
            stats.pending[stats.packs] = weakref.ref(packed)
            stats.packs += 1
            stats.offloaded_bytes += packed.nbytes
            stats.tensors += 1
            stats.host_bytes += packed.nbytes
            stats.host_peak_bytes = max(stats.host_peak_bytes, stats.host_bytes)
        weakref.finalize(packed, _release, stats, packed.nbytes, packed.index)
        self._seen[key] = packed
        return packed

    def _fetch(self, p: OffloadedTensor) -> tuple[torch.Tensor, torch.Event | None]:
        """Start the copy back of `p`: (the device tensor, the event that ends the copy or None)."""
        if p.device.type == "cpu":
            return _restore(p, p.host.clone()), None
        side = _side_stream(p.device)
        side.wait_event(p.event)
        with side:  # allocated on the side stream; the consumer's stream is recorded at unpack
            buf = torch.empty(p.host.shape, dtype=p.dtype, device=p.device)
            buf.copy_(p.host, non_blocking=True)
            out = _restore(p, buf)
            return out, side.record_event()

    def unpack(self, p):
        """Autograd's unpack hook: the saved tensor back on its device, as saved."""
        if not isinstance(p, OffloadedTensor):
            return p
        last = p.last() if p.last is not None else None
        if last is not None:  # saved by several nodes: the copy already back serves them all
            return last
        if p.ready is not None:
            out, event = p.ready, p.ready_event
            p.ready = p.ready_event = None
        else:
            out, event = self._fetch(p)
        with _LOCK:
            p.fetched = True
            self.stats.pending.pop(p.index, None)
        if event is not None:
            current = torch.accelerator.current_stream(p.device)
            current.wait_event(event)
            out.record_stream(current)
        p.last = weakref.ref(out)
        if self.prefetch:
            self._prefetch_before(p.index)
        return out

    def _prefetch_before(self, k: int) -> None:
        """Start the copy back of the latest item before `k` not yet fetched, if any."""
        pending = self.stats.pending
        with _LOCK:  # pending holds unfetched live items only: in a reverse-order backward the
            # first index below k comes first
            j = next((j for j in reversed(pending) if j < k), None)
            q = pending.pop(j)() if j is not None else None
            if q is None:
                return
            q.fetched = True
            self.stats.prefetched += 1
        if q.device.type != "cpu":  # on the CPU the copy back stays in its unpack
            q.ready, q.ready_event = self._fetch(q)


@functools.cache
def _side_stream(device: torch.device) -> torch.Stream:
    """One side stream per device for every offload of the process: packs and unpacks in order."""
    return torch.Stream(device=device)


def _restore(p: OffloadedTensor, buf: torch.Tensor) -> torch.Tensor:
    """The tensor `p` saved, from its 1-D copy `buf` on the target device."""
    if p.compact:
        out = torch.empty_strided(p.shape, p.stride, dtype=p.dtype, device=buf.device)
        out.copy_(buf.view(p.shape))
        return out
    return buf.as_strided(p.shape, p.stride, 0)


def offload_block(block: nn.Module, *, stats: OffloadStats | None = None, min_numel: int = 1024,
                  prefetch: bool = True) -> None:
    """Run `block`'s forward inside `offload_saved_activations(skip_ids=<its parameters' ids>)`
    (an instance attribute `forward`, as `trainplan.executor.apply.checkpointing.apply_checkpointing` wraps
    a block; parameter names unchanged). The forward in place before is kept as
    `block.offload_original_forward`; `unoffload_block` puts it back. `stats`: shared by the
    blocks of a model for prefetch across blocks (a fresh one when None, as `block.offload_stats`).

    Order with activation checkpointing: checkpoint first, then offload, i.e.
    `apply_checkpointing(model, ["full"] * n)` then `offload_block(layer)` on each layer, so that
    the offload hooks are outside the checkpoint's. Non-reentrant `torch.utils.checkpoint` saves
    the block's positional inputs before it enters its own hooks (`_CheckpointFrame.save_inputs`,
    `_make_saved_tensor`, in torch 2.13) and saves nothing else of the forward under outer hooks,
    so the offload sees exactly the block inputs: the hidden states (b, s, hidden), the ALST
    checkpoint offload; keyword arguments (position embeddings, masks) are held by the
    checkpoint's closure, not saved, and stay on the device. The other order (offload inside the
    checkpoint) makes the offload hooks innermost: they take every saved tensor of the block, the
    checkpoint's hooks see none and recompute nothing, and the block input stays on the device.

    Raises:
        TrainplanError: `block` is already offloaded.
    """
    if "offload_original_forward" in block.__dict__:
        raise TrainplanError(f"{type(block).__name__} is already offloaded (offload_block was called twice)")
    own = block.__dict__.get("forward")
    original = block.forward
    shared = stats if stats is not None else OffloadStats()

    def forward(*args, **kwargs):
        skip = frozenset(id(p) for p in block.parameters())
        with offload_saved_activations(skip_ids=skip, stats=shared, min_numel=min_numel, prefetch=prefetch):
            return original(*args, **kwargs)

    setattr(block, "offload_original_forward", (own, original))  # noqa: B010 (Module's typed __setattr__)
    setattr(block, "offload_stats", shared)  # noqa: B010
    block.forward = forward


def unoffload_block(block: nn.Module) -> None:
    """Undo `offload_block`: the forward in place before it is back.

    Raises:
        TrainplanError: `block` is not offloaded.
    """
    if "offload_original_forward" not in block.__dict__:
        raise TrainplanError(f"{type(block).__name__} is not offloaded (offload_block was not called on it)")
    own, _ = block.__dict__.pop("offload_original_forward")
    block.__dict__.pop("offload_stats", None)
    if own is None:
        del block.forward
    else:
        block.forward = own
