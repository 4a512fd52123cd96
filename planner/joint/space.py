"""The joint solver's search space: the values each knob may take (`SearchSpace`), the
default space for a device count (`default_space`) and the checks of the bits options."""

from __future__ import annotations

from dataclasses import dataclass

from costmodels.checkpoint_sets import MENU
from costmodels.step import comm
from costmodels.step.precision import check_optimizer_bits, optimizer_bits_for
from modeling.activation_compression import check_activation_bits

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


def default_space(*, devices: int, seq_len: int, n_heads: int, n_kv_heads: int,
                  precision: str, micro_batches=(1, 2, 4, 8, 16), optimizer_bits=None,
                  policies=DEFAULT_POLICIES, data_fractions=(0.25, 0.5, 0.75, 1.0),
                  devices_per_node: int | None = None, activation_bits=(32,)) -> SearchSpace:
    """The search space for `devices` devices: SP degrees that divide the device count, the
    heads and the sequence, and, given `devices_per_node` (the profile's), keep each SP group
    inside one node when the run spans nodes (`comm.sp_degrees_within_node`: SP inside a node,
    data parallelism across nodes); ZeRO stages 0-3 when there is more than one device;
    `optimizer_bits` None: the two widest the executor runs at `precision`
    (`costmodels.step.precision.optimizer_bits_for`: 32 and 8, or 16 and 8 for pure bf16).

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
                       precision=precision, activation_bits=activation_bits)
