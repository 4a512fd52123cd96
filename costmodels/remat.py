"""Activation-checkpoint policies: the menu each transformer block chooses from.

A policy names which ops' outputs a checkpointed block keeps (MUST_SAVE under torch's
selective activation checkpointing, `torch.utils.checkpoint.create_selective_checkpoint_contexts`);
every other op is recomputed at the start of the block's backward. Ops are matched by their
ATen overload name, the level the SAC policy sees at run time and that `planner.capture`
traces (e.g. `aten.mm.default`).

- `none`: no checkpointing, plain autograd.
- `full`: checkpoint the whole block, keep only its inputs (Chen et al. 2016).
- `save_matmuls`: keep matmul and attention outputs, recompute elementwise ops and norms
  (the op-level SAC list of torchtitan, `_save_list`).
- `save_attention`: keep only attention outputs, recompute everything else; at long sequence
  attention dominates compute, so it is the output most worth keeping (AutoSP, sequence-aware
  checkpointing).
"""

from __future__ import annotations

from hardware_profiles.errors import TrainplanError

ATTENTION_OPS = frozenset({
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
})
MATMUL_OPS = frozenset({"aten.mm.default", "aten.addmm.default", "aten.bmm.default"})

POLICIES: dict[str, frozenset[str] | None] = {
    "none": None,
    "full": frozenset(),
    "save_matmuls": MATMUL_OPS | ATTENTION_OPS,
    "save_attention": ATTENTION_OPS,
}


def check_policy(name: str) -> str:
    """Return `name` if it is a known policy.

    Raises:
        TrainplanError: unknown policy; the message lists the known ones.
    """
    if name not in POLICIES:
        raise TrainplanError(f"unknown checkpoint policy {name!r}: known policies are "
                             f"{', '.join(POLICIES)}")
    return name


def is_checkpointed(name: str) -> bool:
    """Whether the policy wraps the block in a checkpoint at all."""
    return POLICIES[check_policy(name)] is not None


def op_is_saved(name: str, op: str) -> bool:
    """Whether policy `name` keeps the output of ATen op `op` (e.g. `aten.mm.default`)."""
    keep = POLICIES[check_policy(name)]
    return keep is None or op in keep
