"""Ulysses sequence parallelism for HF Llama-family models (ZeRO / FSDP2 sharding beside it:
`trainplan.executor.parallel.zero`).

Layout: world = dp x sp. Rank ``r`` is SP rank ``r % sp`` of data-parallel replica ``r // sp``; the
SP groups are the contiguous blocks ``[k*sp, (k+1)*sp)``. Gradients are averaged over the whole
world (the dp x sp group); model states are sharded over it.

Ulysses (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv:2309.14509): every rank holds a contiguous
sequence shard of ``s/P`` tokens for all layers except attention. Around attention one all-to-all
turns the shard into a head shard (all ``s`` tokens, ``h/P`` heads), attention runs unchanged, and a
second all-to-all turns it back. Communication per layer: 4 all-to-alls of ``b*s*h*d/P`` elements
forward (q, k, v, out), the same backward. The all-to-alls return once the backend has released
their buffers (`trainplan.executor.parallel.collectives`); the copies and buffers each one makes, and what autograd
keeps of them, are modelled in `trainplan.costmodels.step.ulysses`. ZeRO stages:
`trainplan.executor.parallel.zero.apply_zero`.

How a training loop calls this module (after ``trainplan.executor.parallel.launch.init_distributed``)::

    sp_group = new_sequence_parallel_group(sp_degree)      # all ranks, once; also sets the SP group
    model = LlamaForCausalLM(config)                        # same seed / weights on every rank
    enable_ulysses(model, seq_len=seq_len)                  # attention -> "ulysses" (sp > 1)
    model, optimizer = apply_zero(model, lambda p: torch.optim.AdamW(p, lr=3e-4),
                                  stage=zero_stage, mesh_or_group=None, device=device)
    for input_ids, labels in replica_batches:               # replica = rank // sp_degree
        ids, tgt, pos = shard_sequence(input_ids, labels, rank % sp_degree, sp_degree)
        logits = forward_logits(model, ids, position_ids=pos)   # trainplan.modeling.model_call
        loss = sp_loss(logits, tgt, None, group=None)      # value: global mean CE, all ranks
        loss.backward(); optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface

from trainplan.errors import TrainplanError
from trainplan.executor.parallel import collectives

ULYSSES = "ulysses"
"""Name of the Ulysses attention function in transformers' AttentionInterface."""

IGNORE_INDEX = -100
"""Label value that contributes no loss (HF convention)."""

# Module-level state: the process group over which Ulysses attention does its all-to-alls.
# None (the default) means no sequence parallelism: the attention function is plain causal SDPA.
_SP_GROUP: dist.ProcessGroup | None = None


# --------------------------------------------------------------------------------------------
# SP group and divisibility
# --------------------------------------------------------------------------------------------


def set_sequence_parallel_group(group: dist.ProcessGroup | None) -> None:
    """Set the process group Ulysses attention uses (module-level, process-wide state).

    Every attention call of every model whose attention implementation is ``"ulysses"`` uses this
    group; one SP group per process is the supported setup. ``None`` turns SP off (plain SDPA).
    """
    global _SP_GROUP
    _SP_GROUP = group


def get_sequence_parallel_group() -> dist.ProcessGroup | None:
    """The group set by `set_sequence_parallel_group`, or None."""
    return _SP_GROUP


def _sp_size(group: dist.ProcessGroup | None) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def valid_sp_degrees(*, seq_len: int | None = None, num_heads: int | None = None) -> list[int]:
    """Degrees that divide ``seq_len`` and ``num_heads`` (each ignored when None)."""
    g = math.gcd(seq_len or 0, num_heads or 0)
    if g == 0:
        raise TrainplanError("valid_sp_degrees needs seq_len or num_heads")
    return [d for d in range(1, g + 1) if g % d == 0]


def check_sp_degree(
    sp_degree: int, *, seq_len: int | None = None, num_heads: int | None = None
) -> None:
    """Raise TrainplanError unless ``sp_degree`` divides ``seq_len`` and ``num_heads`` (if given).

    Ulysses needs both: the sequence is split into ``sp_degree`` equal shards, and the attention
    heads into ``sp_degree`` equal head shards. The message names both numbers and the valid
    degrees.
    """
    if not isinstance(sp_degree, int) or sp_degree < 1:
        raise TrainplanError(f"sp_degree must be a positive integer, got {sp_degree!r}")
    bad = [
        f"{name} {value}"
        for name, value in (("seq_len", seq_len), ("attention heads", num_heads))
        if value is not None and value % sp_degree
    ]
    if bad:
        given = " and ".join(
            f"{name} {value}"
            for name, value in (("seq_len", seq_len), ("attention heads", num_heads))
            if value is not None
        )
        raise TrainplanError(
            f"sp_degree {sp_degree} does not divide {' and '.join(bad)}; valid sp degrees for "
            f"{given}: {valid_sp_degrees(seq_len=seq_len, num_heads=num_heads)}"
        )


def new_sequence_parallel_group(sp_degree: int) -> dist.ProcessGroup | None:
    """Create the SP groups (contiguous rank blocks of ``sp_degree``), set and return this rank's.

    Collective: every rank must call it, in the same order relative to other group creations.
    ``sp_degree`` 1 (the only degree without an initialized process group) sets and returns None.
    A separate group is created even when ``sp_degree`` equals the world size, so that the
    all-to-alls never interleave with gradient collectives on the default group.
    """
    check_sp_degree(sp_degree)
    if sp_degree == 1:
        set_sequence_parallel_group(None)
        return None
    if not dist.is_initialized():
        raise TrainplanError(
            f"sp_degree {sp_degree} needs {sp_degree} processes, but no process group is "
            "initialized (run under torchrun and call init_distributed first)"
        )
    world = dist.get_world_size()
    if world % sp_degree:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise TrainplanError(
            f"sp_degree {sp_degree} does not divide the world size {world}; valid: {divisors}"
        )
    group, _ = dist.new_subgroups(group_size=sp_degree)
    set_sequence_parallel_group(group)
    return group


# --------------------------------------------------------------------------------------------
# Ulysses attention
# --------------------------------------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0 (size P): row j goes to rank j, row i arrives from rank i.

    The map is its own adjoint, so the backward is the same all-to-all applied to the gradient.
    Each direction makes a contiguous send buffer when its input is not contiguous (freed on
    return) and a receive buffer of the same size (returned); it saves nothing for backward.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        collectives.all_to_all_single(out, x, group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        collectives.all_to_all_single(out, grad, ctx.group)
        return out, None


def _seq_to_head(x: torch.Tensor, group: dist.ProcessGroup | None, p: int) -> torch.Tensor:
    """(b, h, s/P, d) sequence shard -> (b, h/P, s, d) head shard (heads [r*h/P, (r+1)*h/P))."""
    b, h, sl, d = x.shape
    x = x.reshape(b, p, h // p, sl, d).permute(1, 0, 2, 3, 4)  # (P, b, h/P, s/P, d): row j->rank j
    x = _AllToAll.apply(x, group)  # row i: sequence shard i of my heads
    return x.permute(1, 2, 0, 3, 4).reshape(b, h // p, p * sl, d)


def _head_to_seq(x: torch.Tensor, group: dist.ProcessGroup | None, p: int) -> torch.Tensor:
    """(b, h/P, s, d) head shard -> (b, s/P, h, d) sequence shard, the layout o_proj expects."""
    b, hp, s, d = x.shape
    sl = s // p
    x = x.reshape(b, hp, p, sl, d).permute(2, 0, 1, 3, 4)  # (P, b, h/P, s/P, d): row j -> rank j
    x = _AllToAll.apply(x, group)  # row i: head shard i of my sequence shard
    return x.permute(1, 3, 0, 2, 4).reshape(b, sl, p * hp, d)


def ulysses_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention over the full sequence from per-rank sequence shards (Ulysses).

    Signature of transformers' AttentionInterface (5.x): ``query`` (b, h, s/P, d), ``key``/``value``
    (b, h_kv, s/P, d) after RoPE with global positions; returns ``(out, None)`` with ``out``
    (b, s/P, h, d). The SP group is the module-level one (`set_sequence_parallel_group`); with
    none set this is plain causal SDPA.

    GQA: query head i uses kv head i // (h/h_kv). When P divides h_kv the kv heads are sharded
    like the q heads. Otherwise each kv head is replicated ``lcm(h_kv, P)/h_kv`` times before the
    all-to-all, so that every rank receives exactly the kv heads its ``h/P`` q heads need (for
    h_kv < P dividing P: one kv head per rank); the replication's backward sums the gradients.

    Only unpadded causal attention: ``attention_mask`` must be None (a custom attention name has
    no HF mask function, so HF passes None; padded positions should carry label -100 instead).
    """
    if attention_mask is not None:
        raise TrainplanError(
            "Ulysses attention supports causal attention without an attention mask; got a mask of "
            f"shape {tuple(attention_mask.shape)}. Mark padding with label -100 instead."
        )
    for unsupported in ("softcap", "sliding_window", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise TrainplanError(f"Ulysses attention does not support {unsupported}")
    group = _SP_GROUP
    p = _sp_size(group)
    h, h_kv = query.shape[1], key.shape[1]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if p > 1:
        check_sp_degree(p, num_heads=h)
        if h_kv % p:
            rep = math.lcm(h_kv, p) // h_kv
            key = key.repeat_interleave(rep, dim=1)
            value = value.repeat_interleave(rep, dim=1)
        query = _seq_to_head(query, group, p)
        key = _seq_to_head(key, group, p)
        value = _seq_to_head(value, group, p)
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        dropout_p=dropout,
        scale=scaling,
        is_causal=bool(is_causal) and query.shape[2] > 1,
        enable_gqa=key.shape[1] != query.shape[1],
    )  # (b, h/P, s, d)
    if p > 1:
        return _head_to_seq(out, group, p), None
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ULYSSES, ulysses_attention_forward)


def enable_ulysses(model: nn.Module, *, seq_len: int | None = None) -> None:
    """Switch an HF model's attention to ``"ulysses"`` and check the SP degree against it.

    Uses the module-level SP group (`new_sequence_parallel_group` / `set_sequence_parallel_group`);
    with SP degree 1 the model is left as it is. Raises TrainplanError when the degree does not
    divide the attention heads (or ``seq_len``, when given). Call before `apply_zero`.
    """
    p = _sp_size(_SP_GROUP)
    if p == 1:
        return
    hf: Any = model  # a transformers model: `config` and `set_attn_implementation` are not nn.Module's
    config = hf.config
    check_sp_degree(p, seq_len=seq_len, num_heads=config.num_attention_heads)
    hf.set_attn_implementation(ULYSSES)
    if config._attn_implementation != ULYSSES:  # models without AttentionInterface dispatch
        raise TrainplanError(
            f"{type(model).__name__} does not dispatch attention through transformers' "
            "AttentionInterface; Ulysses sequence parallelism needs a Llama-family model"
        )


# --------------------------------------------------------------------------------------------
# Data sharding and loss
# --------------------------------------------------------------------------------------------


def shard_sequence(
    input_ids: torch.Tensor, labels: torch.Tensor, rank: int, sp_degree: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contiguous shard ``rank`` of ``sp_degree`` along the sequence dim of a (b, s) batch.

    ``labels`` are in HF convention (aligned with ``input_ids``, the model shifts). They are shifted
    *before* sharding, so the returned ``labels_shard`` holds the next-token targets of the shard's
    positions, including the target across the shard boundary; the last position of the sequence
    gets -100. `sp_loss` therefore does no shifting.

    Returns ``(input_ids_shard, labels_shard, position_ids_shard)``, each (b, s/P); position ids are
    global (``rank*s/P ... (rank+1)*s/P - 1``) as RoPE needs them.
    """
    if input_ids.ndim != 2 or labels.shape != input_ids.shape:
        raise TrainplanError(
            f"shard_sequence expects (batch, seq) input_ids and labels of the same shape, got "
            f"{tuple(input_ids.shape)} and {tuple(labels.shape)}"
        )
    b, s = input_ids.shape
    check_sp_degree(sp_degree, seq_len=s)
    if not 0 <= rank < sp_degree:
        raise TrainplanError(f"SP rank {rank} out of range for sp_degree {sp_degree}")
    targets = torch.cat([labels[:, 1:], labels.new_full((b, 1), IGNORE_INDEX)], dim=1)
    sl = s // sp_degree
    lo, hi = rank * sl, (rank + 1) * sl
    positions = torch.arange(lo, hi, device=input_ids.device).unsqueeze(0).expand(b, -1)
    return input_ids[:, lo:hi].contiguous(), targets[:, lo:hi].contiguous(), positions


def sp_loss(
    logits_shard: torch.Tensor,
    labels_shard: torch.Tensor,
    n_tokens_global: int | None,
    group: dist.ProcessGroup | None,
    *,
    local_sum: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean next-token cross-entropy over the global batch, from one rank's shard.

    ``logits_shard`` (b, s/P, V), ``labels_shard`` (b, s/P) from `shard_sequence` (already shifted,
    -100 ignored). ``n_tokens_global``: number of non-ignored targets over all ranks of ``group``
    (all replicas and shards of this step; with gradient accumulation, of all micro-batches of the
    step); None counts them with one all-reduce (fused with the loss all-reduce).

    ``group`` must be the group over which gradients are *averaged* (`apply_zero` averages over the
    whole dp x sp world; None means the default group). With W its size and S_r the summed CE of
    rank r, the returned tensor has

    - value ``sum_r S_r / N``: the single-process mean CE, identical on every rank;
    - gradient ``W * dS_r / N`` on rank r (a straight-through term, no collective in backward).

    After the average over W ranks the parameter gradient is ``sum_r dS_r / N``, the single-process
    gradient; under SP the all-to-all backward already routes each rank's attention gradients, so
    summing the per-rank parameter gradients is exact. Without a process group this is S / N.
    ``local_sum``: S_r computed by the caller (a tiled loss, `trainplan.modeling.tiling.tiled_ce_sum`, from the
    hidden states, ``logits_shard`` then unused); None computes it from ``logits_shard``.
    """
    if local_sum is not None:
        return _mean_over_ranks(local_sum, labels_shard, n_tokens_global, group)
    v = logits_shard.shape[-1]
    local_sum = F.cross_entropy(
        logits_shard.float().reshape(-1, v),
        labels_shard.reshape(-1).to(logits_shard.device),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return _mean_over_ranks(local_sum, labels_shard, n_tokens_global, group)


def _mean_over_ranks(local_sum: torch.Tensor, labels_shard: torch.Tensor, n_tokens_global: int | None,
                     group: dist.ProcessGroup | None) -> torch.Tensor:
    """`sp_loss`'s value and gradient from this rank's summed cross-entropy `local_sum`."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        n = n_tokens_global
        if n is None:
            n = int((labels_shard != IGNORE_INDEX).sum())
        return local_sum / max(n, 1)
    count = (labels_shard != IGNORE_INDEX).sum()
    stats = torch.stack([local_sum.detach().double(), count.to(local_sum.device).double()])
    dist.all_reduce(stats, group=group)  # [sum_r S_r, sum_r n_r], float64: exact token counts
    n = max(n_tokens_global if n_tokens_global is not None else int(stats[1].item()), 1)
    scaled = local_sum * (world / n)
    return scaled + ((stats[0] / n).to(scaled.dtype) - scaled).detach()

