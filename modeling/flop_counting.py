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


def grouped_mm_flop(a_shape, b_shape, offs_shape=None, bias_shape=None, out_dtype=None, *, out_shape=None,
                    **kwargs) -> int:
    """FLOPs of `aten._grouped_mm` (a mixture of experts' expert matmuls, transformers'
    `grouped_mm` experts), which torch's registry lacks: 2 x the multiply-adds, whatever the
    routing (the groups partition the rows, so their sizes cancel out of the sum). Shapes:
    (S, K) x (E, K, N) -> (S, N), the forward and the input gradient; (K, S) x (S, N) ->
    (E, K, N), the weight gradient; (G, M, K) x (G, K, N) -> (G, M, N), batched."""
    if len(a_shape) == 3 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[-1]
    if len(out_shape) == 2:  # rows of a, grouped weights
        return 2 * out_shape[0] * a_shape[-1] * out_shape[1]
    if len(out_shape) == 3:  # a weight gradient: the rows are contracted
        return 2 * out_shape[1] * a_shape[-1] * out_shape[2]
    return 0


EXTRA_FLOP_FORMULAS = {
    **CPU_ATTENTION_FLOP_FORMULAS,
    torch.ops.aten._grouped_mm: flop_counter.shape_wrapper(grouped_mm_flop),
}
"""Formulas `FlopCounterMode` lacks, for the capture and the executor's `custom_mapping`: the CPU
attention kernels and grouped matmuls."""
for _formula in EXTRA_FLOP_FORMULAS.values():
    _formula._get_raw = True  # torch's own registry entries are marked so (flop_counter.register_flop_formula)
FLOP_FORMULAS = {**flop_counter.flop_registry, **EXTRA_FLOP_FORMULAS}
"""Every op's formula: torch's own registry plus `EXTRA_FLOP_FORMULAS`."""
