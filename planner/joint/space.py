"""The joint solver's search space: the values each knob may take (`SearchSpace`), the
default space for a device count (`default_space`), the checks of the bits options, and the
gradient accumulation a global batch sets for each SP degree and micro-batch (`shapes`)."""

from __future__ import annotations

from dataclasses import dataclass

from costmodels.checkpoint_sets import MENU
from costmodels.step import comm
from costmodels.step.precision import check_optimizer_bits, optimizer_bits_for
from modeling.activation_compression import check_activation_bits
from trainplan_errors import BudgetError

DEFAULT_POLICIES = ("none", "save_matmuls", "save_attention", "full", MENU)
"""Checkpoint menu: the built-in entries plus each block shape's solved Pareto menu."""


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
    (`planner.capture.graph.capture(activation_bits=...)`)."""
    global_batch_tokens: int | None = None
    """Tokens every plan trains per optimizer step, all ranks together: dp_degree x micro_batch
    x seq_len x grad_accum (`shapes`); None: one micro-step per optimizer step (grad_accum 1)."""


def default_space(*, devices: int, seq_len: int, n_heads: int, n_kv_heads: int,
                  precision: str, micro_batches=(1, 2, 4, 8, 16), optimizer_bits=None,
                  policies=DEFAULT_POLICIES, data_fractions=(0.25, 0.5, 0.75, 1.0),
                  devices_per_node: int | None = None, activation_bits=(32,),
                  global_batch_tokens: int | None = None) -> SearchSpace:
    """The search space for `devices` devices: SP degrees that divide the device count, the
    heads and the sequence, and, given `devices_per_node` (the profile's), keep each SP group
    inside one node when the run spans nodes (`comm.sp_degrees_within_node`: SP inside a node,
    data parallelism across nodes); ZeRO stages 0-3 when there is more than one device;
    `optimizer_bits` None: the two widest the executor runs at `precision`
    (`costmodels.step.precision.optimizer_bits_for`: 32 and 8, or 16 and 8 for pure bf16);
    `global_batch_tokens`: tokens per optimizer step (`shapes` sets the accumulation; None: 1).

    Raises:
        TrainplanError: an optimizer width that cannot run at `precision`, or an unknown
            activation width."""
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
                       global_batch_tokens=global_batch_tokens)


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
            and the nearest global batches that are valid (`planner.budget.check_global_batch_tokens`
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
