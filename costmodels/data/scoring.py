"""What scoring a corpus costs, and the solver's (method, fraction) data-subset menu.

Part of the data-value model (`trainplan.costmodels.data.value`). Scoring compute is
charged to the budget (Yin and Rush 2025, "Compute-Constrained Data Selection",
arXiv:2410.16208: counting it, perplexity and gradient scoring pay off only when the trained
model is ~5x resp. ~10x larger than the scoring model); `scoring_flops` gives it, and
`trainplan.executor.data.selection` reports the FLOPs it counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from trainplan.costmodels.checks import check_range
from trainplan.costmodels.data.quality import METHODS, QualityFit, check_fraction
from trainplan.errors import TrainplanError


@dataclass(frozen=True, kw_only=True, slots=True)
class ScoringFlops:
    """FLOPs one scoring pass costs, by part; they add (`+`) and `total` sums them."""

    reference_train_flops: float = 0.0
    """Training the reference / proxy model: 6 * N * tokens (+ attention)."""
    forward_flops: float = 0.0
    """Forward passes over the scored (and target) windows: 2 * N * tokens (+ attention)."""
    backward_flops: float = 0.0
    """Backward passes for per-example gradients (influence): activation gradients only."""
    projection_flops: float = 0.0
    """Random projection of the per-example gradients (influence)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check_range(f"ScoringFlops.{f.name}", getattr(self, f.name), low=0.0, low_open=False)

    @property
    def total(self) -> float:
        """All parts, FLOPs."""
        return (self.reference_train_flops + self.forward_flops + self.backward_flops
                + self.projection_flops)

    def __add__(self, other: ScoringFlops) -> ScoringFlops:
        return ScoringFlops(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                               for f in dataclasses.fields(self)})


def scoring_flops(method: str, n_windows: int, seq_len: int, reference_params: float, *,
                  n_layers: int = 0, hidden: int = 0, target_windows: int = 0,
                  reference_train_tokens: float = 0.0,
                  grad_layers: Iterable[tuple[int, int]] = (), projection_rank: int = 8,
                  rescores: int = 1) -> ScoringFlops:
    """Predicted FLOPs of scoring `n_windows` windows of `seq_len` tokens with `method`.

    reference_params: parameters of the scoring model that enter matrix products (all but an
        untied input-embedding lookup; for a tied model, all of them), N.
    n_layers, hidden: the scoring model's layers and width, for the attention term (per token and
        layer 4 * seq_len * hidden forward, QK^T and AV counted in full as FlopCounterMode counts
        SDPA; 0 leaves it out).
    target_windows: windows of the target set, scored alongside (influence).
    reference_train_tokens: tokens the reference model is trained on first (0: given, no cost).
    grad_layers: (out_features, in_features) of each linear layer whose per-example gradient is
        projected (influence); projection_rank: k per side, so a layer gives k_o * k_i dims.
    rescores: how many times the windows are scored (dynamic selection: steps // rescore_every).

    Formulas (per token T = windows * seq_len): forward 2 N T + 4 n_layers seq_len hidden T;
    reference training three times a forward (Kaplan et al. 2020, 6 N per token); influence adds a
    backward of activation gradients only, another forward's worth (weight gradients are replaced
    by the projected per-example ones), and per layer and token 2 (out k_o + in k_i) + 2 k_o k_i
    for the factored projection (Choe et al. 2024, LoGra, arXiv:2405.13954). random: 0; dsir: 0
    model FLOPs (hashed n-gram counting, a few integer operations per token, counted as 2 per
    n-gram feature).

    Raises: TrainplanError on an unknown method or a negative size.
    """
    if method not in METHODS:
        raise TrainplanError(f"unknown scoring method {method!r}; known: {list(METHODS)}")
    for name, v in (("n_windows", n_windows), ("seq_len", seq_len), ("target_windows",
                    target_windows), ("n_layers", n_layers), ("hidden", hidden),
                    ("rescores", rescores), ("projection_rank", projection_rank)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise TrainplanError(f"{name} must be a whole number >= 0, got {v!r}")
    n = check_range("reference_params", reference_params, low=0.0, low_open=False)
    train_tokens = check_range("reference_train_tokens", reference_train_tokens, low=0.0, low_open=False)
    if method == "random":
        return ScoringFlops()
    tokens = float(n_windows + (target_windows if method != "loss" else 0)) * seq_len
    if method == "dsir":
        return ScoringFlops(forward_flops=2.0 * 2 * tokens * rescores)  # unigram + bigram features
    per_token_fwd = 2.0 * n + 4.0 * n_layers * seq_len * hidden
    train = 3.0 * per_token_fwd * train_tokens
    fwd = per_token_fwd * tokens * rescores
    if method == "loss":
        return ScoringFlops(reference_train_flops=train, forward_flops=fwd)
    k = projection_rank
    proj = sum(2.0 * (o * min(k, o) + i * min(k, i)) + 2.0 * min(k, o) * min(k, i)
               for o, i in grad_layers) * tokens * rescores
    return ScoringFlops(reference_train_flops=train, forward_flops=fwd, backward_flops=fwd,
                        projection_flops=proj)


def reference_scoring_flops(method: str, n_windows: int, seq_len: int, vocab_size: int, *,
                            hidden: int = 32, intermediate: int = 88, layers: int = 2,
                            heads: int = 4, kv_heads: int = 2, train_steps: int = 100,
                            train_micro_batch: int = 8, target_windows: int = 64,
                            projection_rank: int = 8, grad_blocks: int = 2) -> ScoringFlops:
    """`scoring_flops` for `trainplan.executor.data.selection`'s default reference model (a tied-embedding
    Llama; the defaults mirror `trainplan.executor.data.scorers.ReferenceConfig`), trained for
    `train_steps` x `train_micro_batch` windows, before any scoring has run: what the planner
    charges a method it has not tried yet. Matmul parameters per layer: 2 h^2 (q, o) +
    2 h kv_heads (h / heads) (k, v) + 3 h I (gate, up, down), plus the V x h output matrix.

    Raises: TrainplanError on an unknown method or a bad size.
    """
    head_dim = hidden // heads
    kv = kv_heads * head_dim
    per_layer = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
                 (intermediate, hidden), (intermediate, hidden), (hidden, intermediate)]
    n = layers * sum(o * i for o, i in per_layer) + vocab_size * hidden
    grads = per_layer * min(grad_blocks, layers) + [(vocab_size, hidden)]
    return scoring_flops(method, n_windows, seq_len, n, n_layers=layers, hidden=hidden,
                         target_windows=target_windows,
                         reference_train_tokens=float(train_steps * train_micro_batch * seq_len),
                         grad_layers=grads, projection_rank=projection_rank)


@dataclass(frozen=True, kw_only=True, slots=True)
class SelectionOption:
    """One (method, fraction) entry of the solver's data-subset menu."""

    method: str
    fraction: float
    """Share of the corpus's windows kept, (0, 1]."""
    quality: float
    """q(method, fraction), dimensionless."""
    unique_tokens: float
    """fraction * corpus_tokens, tokens."""
    scoring_flops: float
    """FLOPs charged to the budget before training (0 for random)."""


def selection_menu(fits: dict[str, QualityFit], fractions: Sequence[float], *,
                   corpus_tokens: float, scoring: dict[str, float]) -> list[SelectionOption]:
    """The solver's data-subset menu: every (method, fraction) pair worth considering.

    `fits`: the quality multiplier of each method (e.g. `DEFAULT_QUALITY` updated with local
    fits); `scoring`: each method's scoring FLOPs (`scoring_flops(...).total`, or what
    `trainplan.executor.data.selection` counted; a method missing here costs 0). Fraction 1.0 is kept for random
    only (selecting everything is no selection, and would pay for scoring).

    Raises: TrainplanError on an invalid fraction or corpus size.
    """
    corpus = check_range("corpus_tokens", corpus_tokens, low=0.0)
    out = []
    for method, fit in fits.items():
        for f in sorted({check_fraction(x) for x in fractions}):
            if f == 1.0 and method != "random":
                continue
            out.append(SelectionOption(method=method, fraction=f, quality=fit.q(f),
                                       unique_tokens=max(1.0, f * corpus),
                                       scoring_flops=float(scoring.get(method, 0.0))))
    return out
