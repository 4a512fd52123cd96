"""The joint solver's search space: the values each knob may take (`SearchSpace`), the
default space for a device count (`default_space`), the checks of the bits options, and the
gradient accumulation a global batch sets for each SP degree and micro-batch (`shapes`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainplan.costmodels.step import comm
from trainplan.costmodels.step.precision import check_optimizer_bits, optimizer_bits_for
from trainplan.errors import BudgetError, TrainplanError
from trainplan.modeling.activation_compression import check_activation_bits
from trainplan.modeling.tiling import check_chunks
from trainplan.planner.options import DEFAULT_POLICIES


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchSpace:
    """Values each knob may take."""

    sp_degrees: tuple[int, ...]
    zero_stages: tuple[int, ...]
    micro_batches: tuple[int, ...]
    policies: tuple[str, ...]
    optimizer_bits: tuple[int, ...]
    data_fractions: tuple[float, ...]
    precision: str
    activation_bits: tuple[int, ...] = (32,)
    """Saved-activation widths (32 = as computed); each needs its capture variant
    (`trainplan.planner.capture.graph.capture(activation_bits=...)`)."""
    global_batch_tokens: int | None = None
    """Tokens every plan trains per optimizer step, all ranks together: dp_degree x micro_batch
    x seq_len x grad_accum (`shapes`); None: one micro-step per optimizer step (grad_accum 1)."""
    loss_chunks: tuple[int, ...] = (1,)
    """Sequence chunks of the tiled loss (1 = not tiled; `trainplan.costmodels.step.model.Choice.loss_chunks`)."""
    mlp_chunks: tuple[int, ...] = (1,)
    """Sequence chunks of the tiled MLP (1 = not tiled; `Choice.mlp_chunks`)."""
    offload: tuple[bool, ...] = (False,)
    """Activation offload off and/or on (`Choice.offload`)."""
    long_context_when_needed: bool = True
    """True: the long-context knobs' variants are searched only when no plan without them fits
    memory (`trainplan.planner.joint.combos.long_context_combos`); False: wherever a combo does not fit unchecked."""


def default_space(*, devices: int, seq_len: int, n_heads: int, n_kv_heads: int,
                  precision: str, micro_batches=(1, 2, 4, 8, 16), optimizer_bits=None,
                  policies=DEFAULT_POLICIES, data_fractions=(0.25, 0.5, 0.75, 1.0),
                  devices_per_node: int | None = None, activation_bits=(32,),
                  global_batch_tokens: int | None = None, loss_chunks=(1,), mlp_chunks=(1,),
                  offload=(False,), long_context_when_needed: bool = True) -> SearchSpace:
    """The search space for `devices` devices: SP degrees that divide the device count, the
    heads and the sequence, and, given `devices_per_node` (the profile's), keep each SP group
    inside one node when the run spans nodes (`comm.sp_degrees_within_node`: SP inside a node,
    data parallelism across nodes); ZeRO stages 0-3 when there is more than one device;
    `optimizer_bits` None: the two widest the executor runs at `precision`
    (`trainplan.costmodels.step.precision.optimizer_bits_for`: 32 and 8, or 16 and 8 for pure bf16);
    `global_batch_tokens`: tokens per optimizer step (`shapes` sets the accumulation; None: 1);
    `loss_chunks`, `mlp_chunks`, `offload`: the long-context knobs' values (`default_tiling`).

    Raises:
        TrainplanError: an optimizer width that cannot run at `precision`, an unknown
            activation width, a chunk count that is not a power of two, or an offload value
            that is not a bool."""
    sps = [p for p in comm.valid_sp_degrees(seq_len, n_heads, n_kv_heads) if devices % p == 0]
    if devices_per_node is not None:
        sps = comm.sp_degrees_within_node(sps, devices=devices, devices_per_node=devices_per_node)
    optimizer_bits = optimizer_bits_for(precision)[:2] if optimizer_bits is None else tuple(optimizer_bits)
    check_optimizer_bits(optimizer_bits, precision)
    activation_bits = tuple(check_activation_bits(b) for b in activation_bits)
    return SearchSpace(sp_degrees=tuple(sps), zero_stages=(0, 1, 2, 3) if devices > 1 else (0,),
                       micro_batches=tuple(micro_batches), policies=tuple(policies),
                       optimizer_bits=tuple(optimizer_bits), data_fractions=tuple(data_fractions),
                       precision=precision, activation_bits=activation_bits,
                       global_batch_tokens=global_batch_tokens,
                       loss_chunks=check_chunk_options(loss_chunks, "loss_chunks"),
                       mlp_chunks=check_chunk_options(mlp_chunks, "mlp_chunks"),
                       offload=check_offload_options(offload),
                       long_context_when_needed=bool(long_context_when_needed))


def next_pow2(x: float) -> int:
    """The least power of two >= x (1 for x <= 1)."""
    return 1 if x <= 1 else 1 << math.ceil(math.log2(x))


def default_tiling(*, vocab_size: int, hidden_size: int, intermediate_size: int, act_bytes: int,
                   unified_memory: bool) -> dict[str, tuple]:
    """The long-context knobs' default values: each off, or on at one chunk count that brings its
    largest tensor down to about the hidden states' size, where the rest of a block's
    activations already are (more chunks would add recompute overhead, not headroom):

    - `loss_chunks`: 1 or the least power of two >= V x 4 / (h x act_bytes): a chunk's fp32
      logits (cross-entropy upcasts them) no larger than the (b, s, h) hidden states;
    - `mlp_chunks`: 1 or the least power of two >= intermediate / h: a chunk's MLP activations
      no larger than the hidden states;
    - `offload`: off and on, except on a unified-memory device (host memory is device memory).

    These sizes are trainplan's rule, not a published one; pass other counts to `solve` to search
    them (each is one more capture of the tiled region)."""
    kl = next_pow2(vocab_size * 4 / (hidden_size * act_bytes))
    km = next_pow2(intermediate_size / hidden_size) if intermediate_size else 1
    return dict(loss_chunks=tuple(sorted({1, kl})), mlp_chunks=tuple(sorted({1, km})),
                offload=(False,) if unified_memory else (False, True))


def check_chunk_options(values, what: str) -> tuple[int, ...]:
    """`values` (chunk counts for `what`: a tuple, or one count) as a tuple, each a power of two
    >= 1: the capture traces a tiled region at a sequence of chunks x an odd prime, so a chunk's
    dimensions never collide with the micro-batch's (`trainplan.planner.capture.trace`). The values are
    what the solver may choose from; the untiled plan is always among its plans.

    Raises:
        TrainplanError: empty, a string, not whole numbers >= 1, or not powers of two."""
    if isinstance(values, (str, bytes)):
        raise TrainplanError(f"{what}={values!r} is not valid: give chunk counts, e.g. (1, 8)")
    seq = values if isinstance(values, (tuple, list)) else (values,)
    out = tuple(check_chunks(v, what=what) for v in seq)
    if not out or any(v & (v - 1) for v in out):
        raise TrainplanError(f"{what}={values!r} is not valid: give chunk counts that are powers of "
                             "two (1 = not tiled), e.g. (1, 8)")
    return out


def check_offload_options(values) -> tuple[bool, ...]:
    """`values` (offload off and/or on: a tuple of bools, or one bool) as a tuple: the values the
    solver may choose from; a plan without offload is always among its plans.

    Raises:
        TrainplanError: empty, or not True/False."""
    seq = values if isinstance(values, (tuple, list)) else (values,)
    if not seq or not all(isinstance(v, bool) for v in seq):
        raise TrainplanError(f"offload={values!r} is not valid: give True, False or (False, True)")
    return tuple(seq)


def grad_accum_for(global_batch_tokens: int | None, *, devices: int, sp_degree: int, micro_batch: int,
                   seq_len: int) -> int | None:
    """Micro-steps per optimizer step that train exactly `global_batch_tokens` tokens per step
    at this SP degree and micro-batch: N / (dp_degree x micro_batch x seq_len) with dp_degree =
    devices / sp_degree, when that is a whole number >= 1, else None (no such plan). 1 when
    `global_batch_tokens` is None (no global batch: one micro-step per optimizer step)."""
    if global_batch_tokens is None:
        return 1
    per_micro_step = devices // sp_degree * micro_batch * seq_len  # tokens, all ranks
    ga, rest = divmod(global_batch_tokens, per_micro_step)
    return ga if ga >= 1 and rest == 0 else None


def shapes(space: SearchSpace, *, devices: int, seq_len: int) -> list[tuple[int, int, int]]:
    """The (sp_degree, micro_batch, grad_accum) of `space` on `devices` devices at `seq_len`:
    every SP degree and micro-batch with grad_accum 1 without a global batch; with one, those
    whose accumulation is a whole number (`grad_accum_for`), each with it.

    Raises:
        BudgetError: a global batch no SP degree and micro-batch divides; the message names it
            and the nearest global batches that are valid (`trainplan.planner.budget.check_global_batch_tokens`
            checked its type before)."""
    out = []
    for sp in space.sp_degrees:
        for mb in space.micro_batches:
            ga = grad_accum_for(space.global_batch_tokens, devices=devices, sp_degree=sp, micro_batch=mb,
                                seq_len=seq_len)
            if ga is not None:
                out.append((sp, mb, ga))
    n = space.global_batch_tokens
    if out or n is None or not space.sp_degrees or not space.micro_batches:
        return out
    units = sorted({devices // sp * mb * seq_len for sp in space.sp_degrees for mb in space.micro_batches})
    below = max((n // u * u for u in units if n >= u), default=None)
    above = min(-(-n // u) * u for u in units)
    near = (f"global batches are {below} and {above}" if below is not None
            else f"global batch is {above}")
    raise BudgetError(
        f"global_batch_tokens={n} is not a whole number of micro-steps of any plan on {devices} "
        f"device(s) at seq_len {seq_len} (dp_degree x micro_batch x seq_len x grad_accum, micro-batches "
        f"{', '.join(map(str, space.micro_batches))}, SP degrees {', '.join(map(str, space.sp_degrees))}): "
        f"the nearest valid {near} tokens")
