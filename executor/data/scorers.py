"""The scoring methods behind `trainplan.executor.data.selection`: a reference model, per-window loss, LESS-style
gradient influence, DSIR n-gram importance, random. Each returns one raw number per window and the
FLOPs it spent (FlopCounterMode on the first batch, scaled by the windows; `trainplan.costmodels.data.scoring.
scoring_flops` is the analytic counterpart).

Windows follow `trainplan.executor.data.batches.TokenBatches`: window i is tokens[i*seq_len : i*seq_len+seq_len+1],
inputs window[:-1], labels window[1:].
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from trainplan.errors import TrainplanError, require_extra
from trainplan.executor.data.batches import TokenBatches, check_window_args, gather_windows
from trainplan.executor.data.dsir import score_dsir
from trainplan.modeling.flop_counting import EXTRA_FLOP_FORMULAS
from trainplan.modeling.model_call import forward_logits

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class ReferenceConfig:
    """A small Llama-shaped reference (proxy) model, trained briefly on a random subset of the
    windows to be scored: the 'small reference model' of Ankner et al. 2024 and the warmed-up
    proxy of LESS (Xia et al. 2024, trained on a random 5% first)."""

    hidden_size: int = 32
    intermediate_size: int = 88
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    tie_word_embeddings: bool = True
    """Tied input/output embeddings: the vocabulary matrix, most of a tiny model, counted once."""
    steps: int = 100
    """Optimizer steps of reference training."""
    micro_batch: int = 8
    """Windows per step."""
    lr: float = 1e-2
    """AdamW peak learning rate, linear warmup over 10% of the steps, then constant."""
    train_fraction: float = 0.25
    """Share of the scored windows the reference trains on (a random subset, `seed`)."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "steps", "micro_batch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise TrainplanError(f"ReferenceConfig.{name} must be a whole number >= 1, "
                                     f"got {v!r}")
        if not 0.0 < self.train_fraction <= 1.0:
            raise TrainplanError(f"ReferenceConfig.train_fraction must be in (0, 1], got "
                                 f"{self.train_fraction!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise TrainplanError(f"ReferenceConfig.lr must be > 0, got {self.lr!r}")

    def fingerprint(self) -> str:
        return "config:" + hashlib.sha256(json.dumps(asdict(self), sort_keys=True)
                                          .encode()).hexdigest()[:32]


def build_reference(config: ReferenceConfig, vocab_size: int, seq_len: int) -> nn.Module:
    """The reference model (transformers `LlamaForCausalLM`, fp32, SDPA), random init with
    `config.seed`."""
    import transformers  # seconds to import: only when a reference model is built

    cfg = transformers.LlamaConfig(
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, vocab_size=vocab_size,
        max_position_embeddings=max(256, seq_len + 1),
        tie_word_embeddings=config.tie_word_embeddings, use_cache=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(config.seed)
    model = transformers.LlamaForCausalLM(cfg)
    model.config.use_cache = False
    return model


def model_fingerprint(model: nn.Module) -> str:
    """sha256 of a model's class and state (names, dtypes, shapes, values): changes when any
    weight does."""
    h = hashlib.sha256(type(model).__qualname__.encode())
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "model:" + h.hexdigest()[:32]


def matmul_params(model: nn.Module) -> int:
    """Parameters that enter matrix products: all but an untied input embedding (a lookup), the
    N of 2 N FLOPs per token."""
    n = sum(p.numel() for p in model.parameters())
    hf: Any = model  # a transformers model has the embedding getters; nn.Module does not
    emb = hf.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = hf.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if emb is not None and (out is None or out.weight is not emb.weight):
        n -= emb.weight.numel()
    return n


def _counted(fn: Callable[[], T]) -> tuple[T, float]:
    """Run `fn` under FlopCounterMode; (its result, FLOPs)."""
    fc = FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS)
    with fc:
        out = fn()
    return out, float(fc.get_total_flops())


def _batches(starts: np.ndarray, batch_size: int, progress: bool, desc: str):
    chunks = [starts[i:i + batch_size] for i in range(0, len(starts), batch_size)]
    if progress:
        tqdm = require_extra("tqdm", "run", "the scoring progress bar").tqdm
        return tqdm(chunks, desc=desc, unit="batch", disable=None)  # None: off unless a TTY
    return chunks


def train_reference(tokens, *, seq_len: int, vocab_size: int, config: ReferenceConfig,
                    windows: np.ndarray | None = None, progress: bool = False
                    ) -> tuple[nn.Module, float]:
    """Train the reference model on a random `config.train_fraction` of `windows` (all windows
    when None) for `config.steps` steps; returns (model in eval mode, training FLOPs counted).

    Raises: DataError (from TokenBatches) when the tokens hold no window.
    """
    n_windows = (len(tokens) - 1) // seq_len
    pool = np.arange(n_windows) if windows is None else np.asarray(windows, dtype=np.int64)
    rng = np.random.default_rng(config.seed)
    n_keep = max(1, round(config.train_fraction * len(pool)))
    keep = np.sort(rng.choice(pool, size=n_keep, replace=False))
    batches = TokenBatches(tokens, seq_len=seq_len, micro_batch=config.micro_batch,
                           keep_indices=keep, seed=config.seed)
    model = build_reference(config, vocab_size, seq_len)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95),
                            weight_decay=0.1, foreach=False)
    warm = max(1, config.steps // 10)

    def step(s: int) -> float:
        for g in opt.param_groups:
            g["lr"] = config.lr * min(1.0, (s + 1) / warm)
        x, y = batches.batch(s)
        loss = F.cross_entropy(forward_logits(model, x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    steps = range(config.steps)
    if progress:
        tqdm = require_extra("tqdm", "run", "the reference model's progress bar").tqdm
        steps = tqdm(steps, desc="reference model", unit="step", disable=None)
    flops = 0.0
    for s in steps:
        if s == 0:
            _, per_step = _counted(lambda: step(0))
            flops = per_step * config.steps
        else:
            step(s)
    model.eval()
    return model, flops


# ---- scorers: (raw scores (n,), FLOPs) ------------------------------------------------------


def score_random(tokens, starts: np.ndarray, *, seed: int, **_) -> tuple[np.ndarray, float]:
    """Uniform [0, 1) scores from `default_rng(seed)`: their top-k is a uniform random subset."""
    return np.random.default_rng(seed).random(len(starts)), 0.0


@torch.no_grad()
def score_loss(tokens, starts: np.ndarray, *, seq_len: int, model: nn.Module, batch_size: int,
               progress: bool = False, **_) -> tuple[np.ndarray, float]:
    """Mean next-token cross-entropy (nats) of each window under `model` (eval mode, no grad)."""
    was = model.training
    model.eval()
    dev = next(model.parameters()).device
    out, flops = [], 0.0
    try:
        for i, chunk in enumerate(_batches(starts, batch_size, progress, "loss scores")):
            x, y = gather_windows(tokens, chunk, seq_len)

            def run(x=x, y=y):
                logits = forward_logits(model, x.to(dev)).float()
                return F.cross_entropy(logits.transpose(1, 2), y.to(dev),
                                       reduction="none").mean(1)

            if i == 0:
                losses, f = _counted(run)
                flops = f * len(starts) / len(chunk)
            else:
                losses = run()
            out.append(losses.cpu().numpy())
    finally:
        model.train(was)
    return np.concatenate(out).astype(np.float64), flops


def grad_layers(model: nn.Module, grad_blocks: int) -> list[nn.Linear]:
    """The linear layers whose per-example gradients influence uses: those of the last
    `grad_blocks` transformer blocks (`model.model.layers`, HF Llama/Qwen) plus `lm_head`; for
    another architecture every nn.Linear."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return [m for m in model.modules() if isinstance(m, nn.Linear)]
    blocks = list(layers)[len(layers) - min(grad_blocks, len(layers)):] if grad_blocks > 0 else []
    mods = [m for blk in blocks for m in blk.modules() if isinstance(m, nn.Linear)]
    head = getattr(model, "lm_head", None)
    return mods + ([head] if isinstance(head, nn.Linear) else [])


def _rademacher(k: int, n: int, seed: int, j: int, side: int) -> torch.Tensor | None:
    """(k, n) Rademacher matrix scaled by 1/sqrt(k) (E[P^T P] = I), or None when k >= n (no
    projection on that side)."""
    if k >= n:
        return None
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + 2 * j + side)
    return (torch.randint(0, 2, (k, n), generator=g).float() * 2 - 1) / math.sqrt(k)


def _projected_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mods: list[nn.Linear],
                     projs: list[tuple]) -> torch.Tensor:
    """(B, d) projected per-example gradients of each window's mean cross-entropy w.r.t. the
    weights of `mods`.

    For a linear layer y = a W^T, window i's weight gradient is G_i = sum_t g_it^T a_it (g: output
    gradient, a: input), so with projections P_o (k_o, out), P_i (k_i, in) the factored projection
    P_o G_i P_i^T = sum_t (P_o g_it)^T (P_i a_it) needs no per-example (out, in) matrix (Choe et
    al. 2024, LoGra). The backward asks autograd for the layers' output gradients only, so no
    weight gradient is formed. Windows are independent in the batch, so the summed loss's output
    gradients are the per-example ones."""
    store: dict[int, list] = {}
    handles = []
    for j, m in enumerate(mods):
        handles.append(m.register_forward_hook(
            lambda mod, inp, out, j=j: store.setdefault(j, []).append((inp[0], out))))
    try:
        logits = forward_logits(model, x)
    finally:
        for h in handles:
            h.remove()
    per_example = F.cross_entropy(logits.float().transpose(1, 2), y, reduction="none").mean(1)
    calls = [(j, a, o) for j in sorted(store) for a, o in store[j]]
    grads = torch.autograd.grad(per_example.sum(), [o for _, _, o in calls], allow_unused=True)
    parts: dict[int, torch.Tensor] = {}
    for (j, a, _), g in zip(calls, grads, strict=False):
        p_out, p_in = projs[j]
        if g is None:
            continue
        pa = a.float() if p_in is None else a.float() @ p_in.T  # (B, T, k_i)
        pg = g.float() if p_out is None else g.float() @ p_out.T  # (B, T, k_o)
        gj = torch.einsum("bto,bti->boi", pg, pa).reshape(x.shape[0], -1)
        parts[j] = parts[j] + gj if j in parts else gj
    dims = [(projs[j][0].shape[0] if projs[j][0] is not None else m.out_features)
            * (projs[j][1].shape[0] if projs[j][1] is not None else m.in_features)
            for j, m in enumerate(mods)]
    return torch.cat([parts.get(j, torch.zeros(x.shape[0], d)) for j, d in enumerate(dims)], 1)


def projected_gradients(model: nn.Module, tokens, starts: np.ndarray, *, seq_len: int,
                        batch_size: int, rank: int, seed: int, grad_blocks: int,
                        progress: bool = False, desc: str = "gradients"
                        ) -> tuple[np.ndarray, float]:
    """((n, d) float32 projected per-example gradients, FLOPs) of the windows at `starts`.
    d = sum over `grad_layers` of min(rank, out) * min(rank, in)."""
    mods = grad_layers(model, grad_blocks)
    if not mods:
        raise TrainplanError("influence scoring found no linear layer to take gradients of")
    projs = [(_rademacher(rank, m.out_features, seed, j, 0), _rademacher(rank, m.in_features,
                                                                        seed, j, 1))
             for j, m in enumerate(mods)]
    dev = next(model.parameters()).device
    projs = [(None if a is None else a.to(dev), None if b is None else b.to(dev)) for a, b in projs]
    was = model.training
    flags = [(m.weight, m.weight.requires_grad) for m in mods]
    model.eval()
    out, flops = [], 0.0
    try:
        for m in mods:
            m.weight.requires_grad_(True)
        with torch.enable_grad():
            for i, chunk in enumerate(_batches(starts, batch_size, progress, desc)):
                x, y = (t.to(dev) for t in gather_windows(tokens, chunk, seq_len))

                def run(x=x, y=y):
                    return _projected_grads(model, x, y, mods, projs).detach()

                if i == 0:
                    g, f = _counted(run)
                    flops = f * len(starts) / len(chunk)
                else:
                    g = run()
                out.append(g.cpu().numpy().astype(np.float32))
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
        model.train(was)
    return np.concatenate(out), flops


def score_influence(tokens, starts: np.ndarray, *, seq_len: int, model: nn.Module,
                    target_tokens, batch_size: int, rank: int, seed: int, grad_blocks: int,
                    progress: bool = False, **_) -> tuple[np.ndarray, float]:
    """LESS-style influence (Xia et al. 2024, arXiv:2402.04333, Sec. 3; TracIn, Pruthi et al.
    2020, with one checkpoint): cosine similarity between each window's projected gradient and
    the target windows' mean *normalised* projected gradient, i.e. the mean over target windows
    of cos(g_i, v_j) up to a positive constant. Higher: a gradient step on the window lowers the
    target loss more. SGD gradients (LESS uses Adam-preconditioned LoRA gradients over 4
    checkpoints; this is the one-checkpoint SGD variant, cheap on CPU)."""
    target = np.asarray(target_tokens)
    n_target = (len(target) - 1) // seq_len
    if n_target < 1:
        raise TrainplanError(f"influence needs target_tokens with at least seq_len + 1 = "
                             f"{seq_len + 1} tokens, got {len(target)}")
    kw: dict[str, Any] = dict(seq_len=seq_len, batch_size=batch_size, rank=rank, seed=seed,
                              grad_blocks=grad_blocks, progress=progress)
    g_train, f_train = projected_gradients(model, tokens, starts, desc="influence: windows", **kw)
    g_target, f_target = projected_gradients(model, target, np.arange(n_target) * seq_len,
                                             desc="influence: target", **kw)
    unit = lambda g: g / np.maximum(np.linalg.norm(g, axis=1, keepdims=True), 1e-30)  # noqa: E731
    v = unit(g_target).mean(0)
    v /= max(float(np.linalg.norm(v)), 1e-30)
    return (unit(g_train) @ v).astype(np.float64), f_train + f_target


SCORERS: dict[str, Callable[..., tuple[np.ndarray, float]]] = {
    "random": score_random, "loss": score_loss, "influence": score_influence, "dsir": score_dsir}
"""Scoring method name -> scorer; `trainplan.executor.data.selection.score_windows` looks the method up here at
call time (tests patch entries to count calls)."""


def check_tokens(tokens, seq_len: int) -> int:
    """Windows in `tokens` (1-D) at `seq_len`; raises DataError/TrainplanError otherwise."""
    if getattr(tokens, "ndim", 1) != 1:
        raise TrainplanError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
    return check_window_args(len(tokens), seq_len, 1)


def as_numpy_tokens(tokens: torch.Tensor | np.ndarray | Sequence[int]) -> np.ndarray:
    """A 1-D numpy token stream: an integer numpy array (e.g. a memory-mapped uint16 corpus) as
    is, without a copy; a tensor or a sequence as int64."""
    if isinstance(tokens, np.ndarray) and np.issubdtype(tokens.dtype, np.integer):
        return tokens
    if isinstance(tokens, torch.Tensor):
        return tokens.detach().cpu().numpy().astype(np.int64, copy=False)
    return np.asarray(tokens, dtype=np.int64)
