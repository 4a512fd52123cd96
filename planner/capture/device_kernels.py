"""Capture with the target device's kernels: what a CUDA/ROCm device runs where the CPU would
run something else, so that a plan for a GPU profile sees that GPU's saved tensors and FLOPs.

The capture traces on fake CPU tensors. Two choices differ on an accelerator:

- **Attention.** `F.scaled_dot_product_attention` on a CPU picks
  `_scaled_dot_product_flash_attention_for_cpu`, or the math kernel (which stores the s x s
  probabilities) when it cannot, e.g. with dropout. On CUDA/ROCm, torch picks FlashAttention-2
  for fp16/bf16 inputs with head_dim <= 256 and no explicit mask (dropout included: its mask
  is regenerated from a Philox seed, not stored), else memory-efficient attention (fp32, or an
  additive mask), which needs K/V repeated to the query heads for grouped-query attention (torch
  2.13 `aten/src/ATen/native/transformers/sdp_utils_cpp.h` / `cuda/sdp_utils.cpp`:
  `check_head_dim_size_flash`, `check_flash_attention_dtype`, `check_grouped_query_attention`).
  `gpu_sdpa` calls those ATen ops directly; their meta kernels run on fake tensors and
  `torch.utils.flop_counter` has their FLOP formulas.
- **Dropout.** CUDA's fused `native_dropout` keeps a 1-byte bool mask; the CPU path keeps a
  mask in the input's dtype (2 or 4 bytes). `gpu_dropout` calls `aten.native_dropout`.

`target_kernels(device_type)` patches both functions in `torch.nn.functional` while a region is
traced (transformers looks them up at call time); on "cpu" it does nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch

FLASH_MAX_HEAD_DIM = 256
"""FlashAttention-2's largest head dimension (`check_head_dim_size_flash`)."""
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def gpu_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
    """`F.scaled_dot_product_attention` as CUDA/ROCm runs it (module docstring). Shapes:
    query (b, h, s, d), key and value (b, h_kv, s, d); returns (b, h, s, d). Under autocast
    the inputs are cast to its dtype first, as CUDA's autocast casts SDPA's (it is on CUDA's
    lower-precision list; the capture traces under CPU autocast, which stands in for it)."""
    if torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
        query, key, value = (t.to(dtype) for t in (query, key, value))
    flash = (attn_mask is None and query.dtype in FLASH_DTYPES and query.shape[-1] <= FLASH_MAX_HEAD_DIM)
    if flash:
        return torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    if key.shape[-3] != query.shape[-3]:  # memory-efficient attention has no native GQA
        reps = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(reps, dim=-3), value.repeat_interleave(reps, dim=-3)
    needs_grad = query.requires_grad or key.requires_grad or value.requires_grad
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, needs_grad, dropout_p, is_causal, scale=scale)[0]


def gpu_dropout(input, p=0.5, training=True, inplace=False):
    """`F.dropout` as CUDA/ROCm runs it: `aten.native_dropout` with a bool mask."""
    if not training or p == 0.0:
        return input
    return torch.ops.aten.native_dropout(input, p, True)[0]


@contextlib.contextmanager
def target_kernels(device_type: str) -> Iterator[None]:
    """Within the block, attention and dropout run as on `device_type` ("cuda" covers ROCm,
    whose torch device type it is); "cpu": unchanged."""
    if device_type == "cpu":
        yield
        return
    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", gpu_sdpa), \
            mock.patch.object(torch.nn.functional, "dropout", gpu_dropout):
        yield


__all__ = ["FLASH_MAX_HEAD_DIM", "gpu_dropout", "gpu_sdpa", "target_kernels"]
