"""FSDP2's all-gathered parameters and reduce-scatter buffers, beyond the shards that
`trainplan.costmodels.step.memory.model_state_bytes` counts, for ZeRO 2/3 as
`trainplan.executor.parallel.zero.apply_zero` runs
them (`fully_shard` on each transformer block, then on the root module).

Sources: torch 2.13 `torch/distributed/fsdp/_fully_shard/` (`_fsdp_state.py` lazy_init: a root
is kept whole after forward only when `reshard_after_forward` is left unset; `_fsdp_param_group.py`
unshard / post_forward / post_backward; `_fsdp_collectives.py` foreach_all_gather / foreach_reduce)
and per-op MemTracker timelines of 2- and 4-rank gloo runs of tiny-llama (`benchmarks/sp.py`
cases, seq 512 to 2048): each phase below was read off those timelines.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainplan.costmodels.graph import Region


def root_gather_events(region: Region, root_param_bytes: float) -> list[tuple[float, float, float, str]]:
    """FSDP2's root group in the region that ends the model's forward (the tail: final norm,
    LM head, loss), as `simulate_region(extra=...)` events, when the root is resharded after
    its forward (ZeRO-3: `apply_zero` passes `reshard_after_forward=True` to the root too, and
    FSDP2 keeps a root whole only when that is left unset). Whole until the root's forward
    returns the logits (the last forward op reading a parameter here), sharded during the loss,
    all-gathered again by its pre-backward hook when the logits' gradient arrives (before the
    first parameter gradient is made here): for a moment the all-gather's output buffer and the
    whole parameters at once, then whole to the end of the backward."""
    t_out = max((r.last_fwd_use for r in region.storages if r.category == "param"), default=-1)
    t_back = min((r.created for r in region.storages if r.category == "grad"), default=region.n_nodes)
    if root_param_bytes <= 0 or t_out < 0:
        return []
    return [(0.0, t_out + 0.5, root_param_bytes, "param"),
            (t_back - 0.5, t_back - 0.25, root_param_bytes, "temp"),
            (t_back - 0.5, region.n_nodes, root_param_bytes, "param")]


@dataclass(frozen=True, kw_only=True, slots=True)
class FsdpLayout:
    """What FSDP2 holds beyond the shards `ModelStates` counts, for `trainplan.executor.parallel.zero.apply_zero`
    at ZeRO 2/3 over `shard_degree` > 1 ranks: `fully_shard` on each block and on the root
    module, whose own parameters (those in no block: embedding, final norm, LM head) form the
    root group (sources: the module text).

    - An all-gather holds its output buffer and the whole parameters at once, then the whole
      parameters; the root group is all-gathered at the root's pre-forward (head forward).
    - ZeRO-3 (`reshard_after_forward=True`, the root included): a block is whole during its
      forward and its backward; the root group is resharded once its forward returns the
      logits and all-gathered again when their gradient arrives (`root_gather_events`, in
      the tail region), then whole to its reduce-scatter at the end of the backward.
    - ZeRO-2 (`reshard_after_forward=False`): every group stays whole from its forward (or from
      the previous step's held-out evaluation, a no-grad forward) to the end of its backward.
    - The root group's gradients stay whole until its reduce-scatter, in the backward's final
      callback (blocks reduce-scatter theirs when their backward is done, after resharding
      their parameters: `at_reduce`).
    - Buffers are freed where FSDP2 drops them: `trainplan.executor.parallel.zero` installs
      `trainplan.executor.parallel.collectives`' all-gather and reduce-scatter on CPU, which return only once
      gloo's worker thread has let go of them (without that, a loaded run could free the
      root group's all-gather buffer late, on gloo's thread, after the next block's prefetch).
    - A reduce-scatter holds its input (the whole gradients), its output (1/shard_degree) and,
      on gloo (`reduce_scatter_copy`, CPU), one more whole copy."""

    root_param_bytes: float
    """Whole bytes of the root group's parameters."""
    block_param_bytes: tuple[float, ...]
    """Whole bytes of each block's parameters, in execution order."""
    shard_degree: int
    reshard_after_forward: bool
    """True for ZeRO-3, False for ZeRO-2."""
    reduce_scatter_copy: bool = False
    reduce_upcast: float = 1.0
    """Reduce width / gradient width: 2 under `MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32)`, whose reduce-scatter copies the bf16 gradients into an fp32 buffer
    (`_fsdp_collectives.py` foreach_reduce) and keeps fp32 shards; else 1."""

    def unsharded(self, n_blocks: int) -> tuple[float, list[float], float, list[float], float]:
        """All-gathered parameter bytes at (head forward, each block's forward, the tail, each
        block's backward, the head backward); with ZeRO-3 the tail's root group is in the tail
        region's replay (`root_gather_events`), not here."""
        r, blk = self.root_param_bytes, list(self.block_param_bytes)[:n_blocks]
        blk += [blk[-1] if blk else 0.0] * (n_blocks - len(blk))
        if self.reshard_after_forward:
            return 2 * r, [r + 2 * x for x in blk], 0.0, [r + 2 * x for x in blk], r
        whole = r + sum(blk)
        return (max(2 * r, whole), [whole] * n_blocks, whole,
                [r + sum(blk[:i + 1]) for i in range(n_blocks)], r)

    def at_reduce(self, n_blocks: int) -> list[float]:
        """All-gathered parameter bytes while each block's gradients are reduce-scattered: those
        of its backward (`unsharded`) less its own, since FSDP2's post-backward reshards the
        block first (`_fsdp_param_group.py` `FSDPParamGroup.post_backward`: `reshard()`, then
        `foreach_reduce`). ZeRO-2: the root group and the blocks before it; ZeRO-3: the root
        group and the previous block's all-gather buffer, prefetched at this block's
        pre-backward (`_backward_prefetch`; the first block's backward is counted with one
        too, as in `unsharded`)."""
        _, _, _, bwd, _ = self.unsharded(n_blocks)
        blk = list(self.block_param_bytes)[:n_blocks]
        blk += [blk[-1] if blk else 0.0] * (n_blocks - len(blk))
        return [u - x for u, x in zip(bwd, blk, strict=False)]

    def reduce_bytes(self, grad_bytes: float) -> float:
        """Buffers of one group's gradient reduce-scatter beyond its whole gradients (at the
        reduce width)."""
        return grad_bytes * self.reduce_upcast * (1 + 1 / self.shard_degree + (1 if self.reduce_scatter_copy else 0))
