"""Running a model on fake tensors as a training step runs it on real ones (`as_run`), for the
capture (`trainplan.planner.capture`) and the executor's op check (`trainplan.executor.apply.checkpointing.block_ops`).

transformers' mask builder (`transformers.masking_utils`) decides differently when it sees a
fake tensor: it assumes an export and builds every mask (`is_tracing` is true for fake
tensors), and it looks for packed sequences in the position ids. On the real tensors of a
training step with trainplan's batches (no padding mask, one sequence per row, no KV cache) it
builds no causal mask and leaves causality to SDPA's `is_causal`, unless a sliding window
shorter than the sequence needs one. `as_run` makes it decide so on fake tensors too. And torch's
meta kernel of `aten._grouped_mm` (transformers' mixture-of-experts matmuls) holds it to CUDA's
dtype checks (bf16 only), where the CPU kernel also runs fp32: `as_run` checks the shapes at
bf16 and keeps the inputs' dtype.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from trainplan.modeling.torch_private import meta_registrations


@contextlib.contextmanager
def as_run() -> Iterator[None]:
    """Within the block, transformers decides masks on fake tensors as it does on the real
    tensors of a training step (module docstring); torch's fake-tensor errors are not logged
    (a failure is raised once, by the caller)."""
    patches: list[tuple[Any, str, Any]] = []
    mu: Any
    try:
        from transformers import masking_utils as mu
    except ImportError:  # pragma: no cover - transformers is a dependency
        mu = None
    if mu is not None and hasattr(mu, "_ignore_causal_mask_sdpa"):
        orig = mu._ignore_causal_mask_sdpa

        def ignore_causal_mask(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
            # the run's answer (masking_utils._ignore_causal_mask_sdpa on real tensors): no padding,
            # no cache, the window (if any) not below the sequence: SDPA's is_causal does it
            if padding_mask is None and (local_attention_size is None or kv_length < local_attention_size) \
                    and (q_length == 1 or kv_length == q_length):
                return True
            return orig(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size)

        patches.append((mu, "_ignore_causal_mask_sdpa", ignore_causal_mask))
    if mu is not None and hasattr(mu, "find_packed_sequence_indices"):
        patches.append((mu, "find_packed_sequence_indices", lambda position_ids: None))
    meta = meta_registrations
    if hasattr(meta, "_meta_grouped_mm_common"):
        common = meta._meta_grouped_mm_common

        def grouped_mm_meta(mat_a, mat_b, scale_a=None, scale_b=None, **kwargs):
            # the meta kernel holds every _grouped_mm to CUDA's checks (bf16 only); the CPU kernel
            # also runs fp32 and fp16, with the same shapes: check shapes at bf16, keep the dtype
            if scale_a is None and mat_a.dtype == mat_b.dtype and mat_a.dtype in (torch.float32, torch.float16):
                out_dtype = kwargs.pop("out_dtype", None)
                out = common(mat_a.to(torch.bfloat16), mat_b.to(torch.bfloat16), scale_a, scale_b, **kwargs)
                return out.to(out_dtype or mat_a.dtype)
            return common(mat_a, mat_b, scale_a, scale_b, **kwargs)

        patches.append((meta, "_meta_grouped_mm_common", grouped_mm_meta))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    try:
        for obj, name, new in patches:
            setattr(obj, name, new)
        log.setLevel(logging.CRITICAL)
        yield
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)
        log.setLevel(level)
