"""The selection-quality multiplier of a scoring method: how many random tokens one selected
token is worth.

Holds the method names (`METHODS`), the multiplier q(f) = 1 + a * (1 - f)**b of a kept
fraction f (`selection_quality`, `QualityFit`) and its published-number defaults
(`DEFAULT_QUALITY`). The form of q is a modelling assumption; `trainplan.costmodels.data.value` describes
the whole data-value model and gives the loss of a run on a selected subset, and
`trainplan.costmodels.data.fit.fit_quality` fits q per method from pilot runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainplan.costmodels.checks import check_range
from trainplan.errors import TrainplanError

METHODS = ("random", "loss", "influence", "dsir")
"""Scoring methods `trainplan.executor.data.selection` implements."""

QUALITY_FORM = "q(f) = 1 + a * (1 - f)**b"
"""The selection-quality multiplier's functional form (a modelling assumption; see module doc)."""


def check_fraction(value: float) -> float:
    """A kept fraction f of a corpus as a float: finite, in (0, 1] (1: keep everything).

    Raises: TrainplanError "fraction must be > 0.0" / "<= 1.0" otherwise (`check_range`)."""
    return check_range("fraction", value, low=0.0, high=1.0)


def selection_quality(fraction: float, a: float, b: float) -> float:
    """q(f) = 1 + a * (1 - f)**b (`QUALITY_FORM`), dimensionless; q(1) = 1.

    Args: fraction in (0, 1]; a > -1; b > 0.
    Raises: TrainplanError on an input out of range.
    """
    f = check_fraction(fraction)
    a = check_range("a", a, low=-1.0)
    b = check_range("b", b, low=0.0)
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
        check_range("QualityFit.a", self.a, low=-1.0)
        check_range("QualityFit.b", self.b, low=0.0)
        check_range("QualityFit.max_rel_err", self.max_rel_err, low=0.0, low_open=False)

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
