"""The selection-quality multiplier and the predicted loss of a run on a selected subset.

Split out of `costmodels/data/value.py` (which re-exports everything here; its docstring
describes the whole data-value model). Holds the method names, the multiplier
q(f) = 1 + a * (1 - f)**b (`selection_quality`, `QualityFit`), its published-number defaults
(`DEFAULT_QUALITY`) and the loss L = E + A / N**alpha + B / (q * D')**beta of a kept fraction
(`predicted_loss`, `subset_loss`), with D' the effective data of Muennighoff et al. 2023
("Scaling Data-Constrained Language Models", arXiv:2305.16264, eq. 5). The form of q is a
modelling assumption (see `costmodels.data.value`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from costmodels.loss.law import LossLaw, _effective, _finite
from trainplan_errors import TrainplanError

__all__ = ["METHODS", "QUALITY_FORM", "QualityFit", "DEFAULT_QUALITY", "selection_quality",
           "predicted_loss", "subset_loss"]

METHODS = ("random", "loss", "influence", "dsir")
"""Scoring methods `executor.data.selection` implements."""

QUALITY_FORM = "q(f) = 1 + a * (1 - f)**b"
"""The selection-quality multiplier's functional form (a modelling assumption; see module doc)."""


def _num(name: str, value, *, low: float | None = None, low_open: bool = True,
         high: float | None = None) -> float:
    v = _finite(name, value)
    if low is not None and (v <= low if low_open else v < low):
        raise TrainplanError(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and v > high:
        raise TrainplanError(f"{name} must be <= {high}, got {value!r}")
    return v


def _fraction(value) -> float:
    return _num("fraction", value, low=0.0, high=1.0)


def selection_quality(fraction: float, a: float, b: float) -> float:
    """q(f) = 1 + a * (1 - f)**b (`QUALITY_FORM`), dimensionless; q(1) = 1.

    Args: fraction in (0, 1]; a > -1; b > 0.
    Raises: TrainplanError on an input out of range.
    """
    f = _fraction(fraction)
    a = _num("a", a, low=-1.0)
    b = _num("b", b, low=0.0)
    return 1.0 + a * (1.0 - f) ** b


@dataclass(frozen=True, kw_only=True, slots=True)
class QualityFit:
    """The selection-quality multiplier of one scoring method, q(f) = 1 + a * (1 - f)**b."""

    method: str
    """Scoring method, one of `METHODS` (or a user name)."""
    a: float = 0.0
    """q at f -> 0 minus one, dimensionless, > -1. 0: the subset is worth a random one."""
    b: float = 1.0
    """Exponent on the pruned share (1 - f), dimensionless, > 0."""
    n_points: int = 0
    """Pilot runs the constants were fitted on (0: a default)."""
    max_rel_err: float = 0.0
    """Largest |predicted - measured| / measured loss over those runs (in-sample)."""
    source: str = "default"
    """Where the constants come from."""

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or not self.method:
            raise TrainplanError(f"QualityFit.method must be a non-empty name, got {self.method!r}")
        _num("QualityFit.a", self.a, low=-1.0)
        _num("QualityFit.b", self.b, low=0.0)
        _num("QualityFit.max_rel_err", self.max_rel_err, low=0.0, low_open=False)

    def q(self, fraction: float) -> float:
        """q(fraction), dimensionless; see `selection_quality`."""
        return selection_quality(fraction, self.a, self.b)


DEFAULT_QUALITY: dict[str, QualityFit] = {
    "random": QualityFit(method="random", source="no selection: a random subset is worth its size"),
    # Ankner et al. 2024 ("Perplexed by Perplexity", arXiv:2405.20541), abstract and Sec. 4:
    # pruning to 50% by a 125M reference model's perplexity reaches the unpruned 3B model's
    # downstream accuracy in 1/1.45 of the steps, i.e. q(0.5) = 1.45 -> a = 0.9 with b = 1.
    # Measured on downstream accuracy, not loss, at 1B-3B: a prior for large models, refit locally.
    "loss": QualityFit(method="loss", a=0.9, b=1.0,
                       source="Ankner et al. 2024 (arXiv:2405.20541): 1.45x fewer steps at 50% "
                              "kept, read as q(0.5) = 1.45 with b = 1 (downstream accuracy, 1-3B)"),
    # LESS (Xia et al. 2024) and DSIR (Xie et al. 2023) report task accuracy after instruction
    # tuning / continued pretraining, which gives no multiplier on pretraining loss: q = 1 until a
    # local fit says otherwise, so the solver never pays for scoring on faith.
    "influence": QualityFit(method="influence",
                            source="no published pretraining-loss multiplier (LESS, Xia et al. "
                                   "2024, reports task accuracy): q = 1 until fitted"),
    "dsir": QualityFit(method="dsir",
                       source="no published pretraining-loss multiplier (DSIR, Xie et al. 2023, "
                              "reports downstream accuracy): q = 1 until fitted"),
}
"""Quality multipliers used before a local fit, by method."""


def predicted_loss(law: LossLaw, n_params: float, tokens_seen: float, unique_tokens: float | None,
                   quality: float = 1.0) -> float:
    """Predicted final loss, nats per token, of training on `unique_tokens` unique tokens of
    selection quality `quality` until `tokens_seen` tokens.

    L = E + A / N**alpha + B / (quality * D')**beta with D' = `effective_tokens(tokens_seen,
    unique_tokens, law.r_d_star)` (Hoffmann et al. 2022 eq. 2; Muennighoff et al. 2023 eq. 5):
    `LossLaw.predict`. Pass `quality = QualityFit.q(fraction)` for a selected subset.

    Args: n_params (parameters, > 0), tokens_seen (tokens, > 0), unique_tokens (tokens, > 0; None:
    unlimited), quality (dimensionless, > 0).
    Raises: TrainplanError on a non-positive or non-finite input.
    """
    return law.predict(n_params, tokens_seen, unique_tokens=unique_tokens, quality=quality)


def subset_loss(law: LossLaw, n_params: float, tokens_seen: float, corpus_tokens: float,
                fraction: float, fit: QualityFit = DEFAULT_QUALITY["random"], *,
                offset: float = 0.0) -> float:
    """Predicted final loss, nats per token, of keeping `fraction` of a corpus of
    `corpus_tokens` unique tokens by `fit`'s method and training for `tokens_seen` tokens.

    unique = max(1, fraction * corpus_tokens), quality = fit.q(fraction), then `predicted_loss`,
    plus `offset` (nats; e.g. a learning-rate cooldown's gain when the law was fitted on the
    stable phase of runs).

    Raises: TrainplanError on an input out of range.
    """
    f = _fraction(fraction)
    corpus = _num("corpus_tokens", corpus_tokens, low=0.0)
    unique = max(1.0, f * corpus)
    return predicted_loss(law, n_params, tokens_seen, unique, fit.q(f)) + float(offset)


def _curve(law: LossLaw, n_params, tokens: np.ndarray, unique: np.ndarray, q) -> np.ndarray:
    """Vectorised `predicted_loss` (arrays broadcast)."""
    eff = _effective(tokens, unique, law.r_d_star)
    return law.E + law.A / n_params**law.alpha + law.B / (q * eff) ** law.beta
