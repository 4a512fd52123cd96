"""Saved-activation compression: what autograd keeps for the backward, stored in fewer bits.

One implementation serves both sides: `trainplan.executor.train` runs a step's forward inside
`compress_saved_activations(bits)`, and `trainplan.planner.capture.graph` traces each region inside the same
context, so the quantize ops of the forward, the compressed copies' lifetimes and the
dequantize temporaries of the backward are in the captured graph the memory and time models
replay (`trainplan.costmodels.step.memory.simulate_region`, `trainplan.costmodels.step.roofline.region_cost`):
nothing about the
compression is modelled by hand.

Built on `torch.autograd.graph.saved_tensors_hooks` (pack when autograd saves a tensor for the
backward, unpack when the backward reads it), the mechanism of ActNN (Chen et al. 2021, ICML,
arXiv:2104.14129, Sec. 4) and GACT (Liu et al. 2022, ICML, arXiv:2206.11357). Widths:

- 32: as computed (no hooks);
- 16: floating tensors wider than 16 bits are stored as bf16;
- 8: floating tensors are stored as int8 with one fp32 scale per channel (the last dimension:
  amax over the other dimensions / 127, symmetric round-to-nearest), as LLM.int8()'s
  vector-wise quantization scales per row/column (Dettmers et al. 2022, arXiv:2208.07339,
  Sec. 3.1); the scale is computed with two reductions (amax, amin), so packing makes no
  full-size temporary beyond the quotient.

Not compressed: parameters and their autocast casts (weights, not activations), integer and
bool tensors, tensors of fewer than `MIN_NUMEL` elements or fewer than 2 dimensions. A tensor
saved by several backward nodes is packed once (keyed by storage, offset, shape, stride,
version and dtype). Composition with activation checkpointing: `torch.utils.checkpoint`
(non-reentrant, selective included) installs its own saved-tensor hooks inside a checkpointed
region, and the innermost hooks win, so tensors of a checkpointed block are neither compressed
in the forward nor when the backward recomputes them; the block's input, held by the
checkpoint, stays as computed too.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from trainplan.errors import TrainplanError

ACTIVATION_BITS = (32, 16, 8)
"""Valid saved-activation widths; 32 means as computed (bf16 tensors stay bf16)."""
MIN_NUMEL = 1024
"""Tensors smaller than this are kept as computed (their scale would cost more than it saves)."""


def check_activation_bits(bits) -> int:
    """`bits` as an int, if valid.

    Raises:
        TrainplanError: not one of `ACTIVATION_BITS`.
    """
    if isinstance(bits, bool) or bits not in ACTIVATION_BITS:
        raise TrainplanError(f"activation_bits={bits!r} is not supported: use "
                             f"{', '.join(map(str, ACTIVATION_BITS))} (32 = as computed)")
    return int(bits)


class _Packed:
    """A compressed saved tensor: codes, per-channel scale (8 bits), original dtype."""

    __slots__ = ("codes", "scale", "dtype", "source", "__weakref__")

    def __init__(self, codes, scale, dtype, source):
        self.codes, self.scale, self.dtype, self.source = codes, scale, dtype, source


def is_weight(t: torch.Tensor, param_ids: frozenset[int]) -> bool:
    """A parameter (an `nn.Parameter`, or a tensor whose id is in `param_ids`: the fake parameters
    of a capture), a view of one (`weight.t()` saved by mm), or autocast's cast of one
    (ToCopyBackward0 -> AccumulateGrad): what saved-tensor hooks leave alone as weights, not
    activations (here and in `trainplan.modeling.offload`)."""
    root = t._base if t._base is not None else t
    if isinstance(root, nn.Parameter) or id(root) in param_ids or id(t) in param_ids:
        return True
    fn = root.grad_fn
    while fn is not None and type(fn).__name__ in ("ToCopyBackward0", "TBackward0", "ViewBackward0",
                                                   "TransposeBackward0", "PermuteBackward0"):
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return False
        fn = nxt[0]
        var = getattr(fn, "variable", None)
        if var is not None:
            return isinstance(var, nn.Parameter) or id(var) in param_ids
    return False


class SavedActivationCompression(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: tensors autograd saves inside it are stored at `bits` (8 or 16).

    `param_ids`: `id()`s of tensors to treat as parameters besides `nn.Parameter`s (the capture
    passes its fake parameters). Use only around the forward; the backward unpacks.

    Raises:
        TrainplanError: `bits` not 8 or 16 (use no context for 32).
    """

    def __init__(self, bits: int, param_ids: frozenset[int] = frozenset(), *, record: bool = False):
        bits = check_activation_bits(bits)
        if bits == 32:
            raise TrainplanError("activation_bits=32 keeps saved activations as computed: "
                                 "use `compress_saved_activations(32)` (no hooks)")
        self.bits, self.param_ids = bits, frozenset(param_ids)
        self.packed_bytes = 0
        """Bytes of compressed copies made so far (codes + scales), for tests and reports."""
        self.unpacked: list[tuple[_Packed, torch.Tensor]] | None = [] if record else None
        """With `record=True` (the capture): each unpack's (packed, result), so that a packed
        copy lives until the backward node that unpacked it is done."""
        self._seen: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        super().__init__(self._pack, self._unpack)

    def _skip(self, t: torch.Tensor) -> bool:
        return (not t.is_floating_point() or t.dim() < 2 or t.numel() < MIN_NUMEL
                or (self.bits == 16 and t.element_size() <= 2) or is_weight(t, self.param_ids))

    def _pack(self, t: torch.Tensor):
        if self._skip(t):
            return t
        ref = StorageWeakRef(t.untyped_storage())  # holds the storage's address while we live
        key = (ref.cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t._version, t.dtype)
        hit = self._seen.get(key)
        if hit is not None:
            return hit
        with torch.no_grad():
            if self.bits == 16:
                packed = _Packed(t.to(torch.bfloat16), None, t.dtype, ref)
            else:
                dims = tuple(range(t.dim() - 1))
                amax = torch.maximum(t.amax(dim=dims), t.amin(dim=dims).neg())
                scale = (amax.float() / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
                codes = torch.div(t, scale).round_().clamp_(-127, 127).to(torch.int8)
                packed = _Packed(codes, scale, t.dtype, ref)
        self.packed_bytes += packed.codes.numel() * packed.codes.element_size() + (
            packed.scale.numel() * 4 if packed.scale is not None else 0)
        self._seen[key] = packed
        return packed

    def _unpack(self, p):
        if not isinstance(p, _Packed):
            return p
        out = p.codes.to(p.dtype) if p.scale is None else torch.mul(p.codes, p.scale).to(p.dtype)
        if self.unpacked is not None:
            self.unpacked.append((p, out))
        return out


def compress_saved_activations(bits: int, param_ids: frozenset[int] = frozenset(), *,
                               record: bool = False):
    """The context a step's forward runs in: `SavedActivationCompression(bits)` for 8 or 16,
    a no-op for 32.

    Raises:
        TrainplanError: `bits` not in `ACTIVATION_BITS`.
    """
    if check_activation_bits(bits) == 32:
        return contextlib.nullcontext()
    return SavedActivationCompression(bits, param_ids, record=record)
