"""FLOP-counting conventions shared by the capture (predicted FLOPs) and the executor (measured
FLOPs, `torch.utils.flop_counter.FlopCounterMode`): one convention on both sides."""

from __future__ import annotations

import torch
from torch.utils import flop_counter

# FlopCounterMode counts CUDA flash attention but not the CPU kernel; give the CPU ops torch's
# own SDPA formulas so that predicted and measured FLOPs follow one convention (full s^2, the
# causal mask not subtracted; the backward counts 2.5x the forward's matmuls, as torch does).
CPU_ATTENTION_FLOP_FORMULAS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        flop_counter.shape_wrapper(
            lambda q, k, v, *args, out_shape=None, **kw: flop_counter.sdpa_flop_count(q, k, v)),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        flop_counter.shape_wrapper(
            lambda g, q, k, v, *args, out_shape=None, **kw:
            flop_counter.sdpa_backward_flop_count(g, q, k, v)),
}
for _formula in CPU_ATTENTION_FLOP_FORMULAS.values():
    _formula._get_raw = True  # torch's own registry entries are marked so (flop_counter.register_flop_formula)
FLOP_FORMULAS = {**flop_counter.flop_registry, **CPU_ATTENTION_FLOP_FORMULAS}
"""Every op's formula: torch's own registry plus the CPU attention kernels above."""
