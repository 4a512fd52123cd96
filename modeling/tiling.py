"""Sequence tiling for long-context training: a computation run over chunks of the sequence so
that only one chunk's intermediates are alive at a time, each chunk recomputed in the backward.

Two uses, both from ALST (Bekman et al. 2025, "Arctic Long Sequence Training",
arXiv:2506.13996): the tiled logits and loss (`tiled_lm_loss`: the LM head and
cross-entropy of one chunk of tokens at a time, so the (b, s, V) logits, their log-softmax and
their gradient are never whole) and TiledMLP (`tile_mlp`: a transformer block's MLP run chunk by
chunk along the sequence, so its (b, s, intermediate) activations are never whole). Both are
exact: the head, the MLP and cross-entropy act on each token alone, so splitting the sequence
changes no value, only the summation order of the loss and of the weight gradients.

Mechanism: each chunk runs under `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`
(non-reentrant activation checkpointing: saved-tensor hooks keep nothing of the chunk's
intermediates and the backward reruns the chunk's forward when it first needs them). Costs:

- memory: one chunk's intermediates (forward, and the recompute plus its gradients in the
  backward) plus the inputs and outputs, which stay whole (the hidden states, the labels, the
  MLP output after `torch.cat`);
- FLOPs: the untiled forward once more (each chunk's forward is recomputed in its backward), so
  a tiled MLP or head costs forward + recompute + backward = about 4/3 of forward + backward; at
  most: the recompute stops after the last tensor the backward needs (torch's early stop), so
  the MLP's down-projection, whose output the backward does not read, is not recomputed.

The gradient of the split input comes back as one full-size `slice_backward` per chunk, summed.

Nested in a block's checkpoint (`trainplan.executor.apply.checkpointing`) the values and gradients are
unchanged, but: under full checkpointing the block's recompute reruns the chunks' forward and
each chunk's backward recomputes it once more; under selective checkpointing (SAC) the policy's
cache keeps the outputs of every chunk's saved ops (all of the MLP's matmul outputs under
`save_matmuls`), so only the backward's transients shrink, and the block runs each MLP op once
per chunk (plus the split and the cat), so positional checkpoint sets (`aten.mm.default#3`)
and `check_block_ops` of a plan captured untiled name other ops.

Dropout inside a tiled computation draws other random numbers than the untiled one (the RNG is
consumed chunk by chunk); the recompute replays each chunk's own draw (`preserve_rng_state`).
Nothing here names a device: the tensors given decide it.
"""

from __future__ import annotations

import contextlib
import functools
import numbers

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from trainplan.errors import TrainplanError
from trainplan.modeling.loss import lm_loss

IGNORE_INDEX = -100
"""Label value that takes no part in the loss (`F.cross_entropy`'s default `ignore_index`)."""
UNTILED_FORWARD_ATTR = "_trainplan_untiled_forward"
"""Instance attribute where `tile_mlp` keeps the MLP's forward as it was before tiling."""
MLP_NAMES = ("mlp", "feed_forward")
"""Child names `find_mlp` looks for, in order: `mlp` (transformers' Llama, Qwen, Mistral, Gemma,
OLMo blocks), `feed_forward` (Llama-4, Mistral-reference style blocks)."""


def check_chunks(chunks, *, what: str) -> int:
    """`chunks` as an int, if it is a whole number >= 1 (1 = not tiled). `what`: the knob's name
    for the message (`loss_chunks`, `mlp_chunks`).

    Raises:
        TrainplanError: `chunks` is a bool, not an integer (2.5, "4") or below 1.
    """
    if isinstance(chunks, bool) or not isinstance(chunks, numbers.Integral) or chunks < 1:
        raise TrainplanError(f"{what}={chunks!r} is not valid: use a whole number >= 1 (1 = not tiled)")
    return int(chunks)


def _n_chunks(chunks: int, seq_len: int) -> int:
    """Chunks actually made: at most one per token (no empty chunk)."""
    return max(1, min(chunks, seq_len))


def chunk_sizes(n: int, chunks: int) -> list[int]:
    """Sizes of `chunks` near-equal pieces of `n` rows, the larger first (as `torch.tensor_split`
    sizes them). The pieces are cut by `torch.split`, whose backward concatenates the pieces'
    gradients once (one (n, h) tensor), where `tensor_split`'s slices would each scatter into a
    zero-filled (n, h) gradient (`slice_backward`) that autograd then adds up: chunks x the
    memory traffic and a third full-size tensor at a time."""
    q, r = divmod(n, chunks)
    return [q + 1] * r + [q] * (chunks - r)


def _chunk_ce_sum(head, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over one chunk of tokens, nats: hidden (c, h), labels (c)."""
    return F.cross_entropy(head(hidden), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def tiled_lm_loss(hidden: torch.Tensor, head, labels: torch.Tensor, chunks: int) -> torch.Tensor:
    """Mean next-token cross-entropy (nats, 0-dim) of `head(hidden)` against `labels`, computed
    `chunks` sequence chunks at a time (ALST's tiled logits and loss, arXiv:2506.13996).

    hidden: (b, s, h), the final norm's output; head: a callable (c, h) -> logits (c, V) over
    c tokens (any leading shape works: a linear LM head); labels: (b, s) int64, already shifted,
    `IGNORE_INDEX` (-100) where a token takes no part. Same value as
    `trainplan.modeling.loss.lm_loss(head(hidden), labels)`: the sum of cross-entropy over the tokens that
    take part, divided by their number (nan when none does).

    chunks == 1: exactly `lm_loss(head(hidden), labels)`. chunks > 1: the b*s tokens (hidden
    viewed as (b*s, h)) split into row ranges by `torch.split` (`chunk_sizes`; contiguous at every
    micro-batch; uneven sizes allowed; at most one chunk per token), each chunk's sum of
    cross-entropy computed under non-reentrant `torch.utils.checkpoint.checkpoint`, so one
    chunk's logits (b*s / chunks, V) are alive at a time in the forward and in the backward,
    which recomputes them (one more head forward over the whole sequence in all). A module
    `head` runs its hooks once per chunk and again in each recompute; MemTracker refuses a
    module called more than once a step, so there hand `head.forward`.

    Raises:
        TrainplanError: `chunks` is not a whole number >= 1 (`check_chunks`).
    """
    chunks = _n_chunks(check_chunks(chunks, what="loss_chunks"), hidden.shape[1])
    if chunks == 1:
        return lm_loss(head(hidden), labels)
    return tiled_ce_sum(hidden, head, labels, chunks) / (labels != IGNORE_INDEX).sum()


def tiled_ce_sum(hidden: torch.Tensor, head, labels: torch.Tensor, chunks: int) -> torch.Tensor:
    """Sum of next-token cross-entropy (nats, 0-dim) over the tokens of `labels` that take part,
    `chunks` sequence chunks at a time, each under non-reentrant checkpoint (as `tiled_lm_loss`,
    which divides it by the tokens; Ulysses SP divides it by the global count,
    `trainplan.executor.parallel.ulysses.sp_loss`). Shapes as `tiled_lm_loss`'s.

    Raises:
        TrainplanError: `chunks` is not a whole number >= 1 (`check_chunks`).
    """
    flat, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    chunks = _n_chunks(check_chunks(chunks, what="loss_chunks"), flat.shape[0])
    fn = functools.partial(_chunk_ce_sum, head)
    parts = [checkpoint(fn, h, lab, use_reentrant=False) if chunks > 1 else fn(h, lab)
             for h, lab in zip(*(torch.split(t, chunk_sizes(flat.shape[0], chunks)) for t in (flat, flat_labels)),
                               strict=True)]
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def tiled_forward(orig, chunks: int, x: torch.Tensor, *args, **kwargs):
    """`orig(x, *args, **kwargs)` computed over `chunks` pieces of `x`'s tokens.

    x: (..., h), e.g. (b, s, h); `orig` must act on each token (each row of the last dimension)
    alone, as an MLP does, and keep the leading dimensions. The tokens are flattened to
    (b*s, h) (a view of a contiguous `x`) and split into `chunks` row ranges (`chunk_sizes`,
    uneven sizes allowed, at most one piece per token): each piece is contiguous whatever the
    micro-batch, so the ops are the same at every batch size (a piece along the sequence of a
    micro-batch > 1 would be strided, and the MLP's reshapes would copy it). Each piece runs
    under non-reentrant `torch.utils.checkpoint.checkpoint(orig, piece, *args, **kwargs)` and the
    outputs are concatenated and viewed back to x's leading shape, so one piece's intermediates
    are alive at a time and the backward recomputes each piece's forward. chunks == 1:
    `orig(x, *args, **kwargs)`, not checkpointed. `args` and `kwargs` go whole to each piece.

    Raises:
        TrainplanError: `chunks` is not a whole number >= 1 (`check_chunks`).
    """
    flat = x.reshape(-1, x.shape[-1])
    chunks = _n_chunks(check_chunks(chunks, what="mlp_chunks"), flat.shape[0])
    if chunks == 1:
        return orig(x, *args, **kwargs)
    with set_checkpoint_early_stop(True):  # also inside a block checkpointed without early stop
        out = torch.cat([checkpoint(orig, piece, *args, use_reentrant=False, **kwargs)
                         for piece in torch.split(flat, chunk_sizes(flat.shape[0], chunks))], dim=0)
    return out.view(*x.shape[:-1], out.shape[-1])


def untile_mlp(mlp: nn.Module) -> None:
    """Give `mlp` back the forward it had before `tile_mlp` (nothing when it is not tiled)."""
    if UNTILED_FORWARD_ATTR not in mlp.__dict__:
        return
    orig = mlp.__dict__.pop(UNTILED_FORWARD_ATTR)
    if getattr(orig, "__self__", None) is mlp and getattr(orig, "__func__", None) is type(mlp).forward:
        mlp.__dict__.pop("forward", None)  # the class's own forward again
    else:
        mlp.forward = orig  # an instance-level forward someone set before tiling


def tile_mlp(mlp: nn.Module, chunks: int) -> None:
    """Make `mlp`'s forward tiled over the sequence in `chunks` pieces (TiledMLP, ALST,
    arXiv:2506.13996): `mlp.forward` becomes the instance attribute
    `functools.partial(tiled_forward, <its untiled forward>, chunks)`; the module is not wrapped,
    so parameter names and state_dict keys are unchanged and hooks on `mlp` still run. The
    untiled forward is kept in `UNTILED_FORWARD_ATTR`; calling again replaces the tiling, and
    chunks == 1 restores the untiled forward (`untile_mlp`). `mlp` takes (b, s, h) hidden
    states and acts on each token alone.

    Raises:
        TrainplanError: `chunks` is not a whole number >= 1 (`check_chunks`).
    """
    chunks = check_chunks(chunks, what="mlp_chunks")
    untile_mlp(mlp)
    if chunks == 1:
        return
    orig = mlp.forward
    mlp.__dict__[UNTILED_FORWARD_ATTR] = orig
    mlp.forward = functools.partial(tiled_forward, orig, chunks)


def find_mlp(block: nn.Module) -> nn.Module:
    """The transformer block's MLP submodule: its child `mlp`, else `feed_forward` (`MLP_NAMES`).

    Raises:
        TrainplanError: `block` has neither child; the message names its class and its children.
    """
    children = dict(block.named_children())
    for name in MLP_NAMES:
        if isinstance(children.get(name), nn.Module):
            return children[name]
    have = ", ".join(children) or "none"
    raise TrainplanError(f"{type(block).__name__} has no MLP child named {' or '.join(MLP_NAMES)} "
                         f"(its children: {have}); MLP tiling needs the block's MLP module")


class TiledHead:
    """The LM head of `model` made a tiled loss inside the model's own forward (`tiled_ce_sum`):
    `with head.labels(y): out = model(input_ids=x)` makes `out.logits` the 0-dim sum of
    cross-entropy over the tokens of `y` that take part, computed `chunks` token chunks at a time
    by the head's own forward, so the logits are never whole. Inside the forward because FSDP2
    holds the root group's parameters (the LM head's among them) unsharded only there and in the
    backward it triggers from the forward's outputs; a loss computed after the forward would meet
    sharded parameters (DTensors). Without labels set (an op check's or a generation's forward)
    the head passes the hidden states through. The head's forward is kept in
    `UNTILED_FORWARD_ATTR`; the module stays (parameter names, FSDP2's groups, tied weights).

    Raises (constructor):
        TrainplanError: the model has no output embedding (`get_output_embeddings()` is None or
            missing), or `chunks` is not a whole number >= 1."""

    def __init__(self, model: nn.Module, chunks: int):
        get = getattr(model, "get_output_embeddings", None)
        head = get() if callable(get) else None
        if not isinstance(head, nn.Module):
            raise TrainplanError(f"{type(model).__name__} has no output embedding (get_output_embeddings()): "
                                 "a tiled loss needs the LM head apart from the model's forward")
        self.chunks = check_chunks(chunks, what="loss_chunks")
        self._labels: torch.Tensor | None = None
        if UNTILED_FORWARD_ATTR not in head.__dict__:
            head.__dict__[UNTILED_FORWARD_ATTR] = head.forward
        self.head_forward = head.__dict__[UNTILED_FORWARD_ATTR]
        head.forward = self._forward

    @contextlib.contextmanager
    def labels(self, labels: torch.Tensor):
        """The labels (b, s) of the next forward's tiled loss."""
        self._labels = labels
        try:
            yield
        finally:
            self._labels = None

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._labels is None:
            return hidden
        return tiled_ce_sum(hidden, self.head_forward, self._labels.to(hidden.device), self.chunks)
