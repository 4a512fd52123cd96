"""Predicted final loss: a Chinchilla-form scaling law with data-constrained repetition.

Loss is in nats per token, measured with the tokenizer and corpus the law was fitted on. The
published constants below come from other tokenizers and corpora (MassiveText for Hoffmann et
al.; C4 for Muennighoff et al.), so their *absolute* values do not transfer: the executor refits
the local law from pilot runs (`LossLaw.fit`). The *shape* (exponents, repetition decay) is what
carries over until then.

Sources:
- Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models" (arXiv:2203.15556),
  Sec. 3.3: eq. 2 (functional form), eq. 3 (Huber fit in log space, L-BFGS from a grid of
  initialisations), constants E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28 (Sec. 3.3 / App. D.2).
- Besiroglu, Erdil, Barnett & You 2024, "Chinchilla Scaling: A replication attempt"
  (arXiv:2404.10102): refit of Approach 3, E=1.8172, A=482.01, B=2085.43, alpha=0.3478,
  beta=0.3658 (their main estimates table), Huber delta=1e-3, loss summed not averaged.
- Muennighoff et al. 2023, "Scaling Data-Constrained Language Models" (NeurIPS; arXiv:2305.16264),
  Sec. 3: effective data D' = U_D + U_D R_D* (1 - exp(-R_D / R_D*)) (eq. 5) and the analogous N'
  (eq. 6); fitted R_D* = 15.387756, R_N* = 5.309743.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from numpy.typing import ArrayLike

from costmodels.checks import check_finite, check_non_negative, check_positive
from costmodels.loss.bits import BitsPenalty
from costmodels.loss.fit import HUBER_DELTA, check_fit_arrays, huber_fit
from trainplan_errors import TrainplanError

#: Muennighoff et al. 2023, Sec. 3 (fit reported as R_D* = 15.387756): repetitions of the data
#: after which a repeated token is worth 1/e of a fresh one.
R_D_STAR = 15.4
#: Muennighoff et al. 2023, Sec. 3 (fit reported as R_N* = 5.309743): the same decay constant for
#: parameters in excess of the compute-optimal size for the unique data.
R_N_STAR = 5.3

_FIT_NAMES = ("E", "A", "B", "alpha", "beta")


def effective_array(tokens_seen: np.ndarray, unique_tokens: float | np.ndarray, r_star: float) -> np.ndarray:
    """Muennighoff et al. 2023 eq. 5 on arrays, without input checks (`effective_tokens` is the
    checked scalar form; `effective_params` applies the same decay to parameters, eq. 6).

    Args: tokens_seen (tokens, >= 0), unique_tokens (tokens, > 0; a scalar or an array that
    broadcasts with `tokens_seen`), r_star (repetitions, > 0).
    Returns: effective tokens, the broadcast shape: `tokens_seen` itself where it is at most
    `unique_tokens` (one epoch or less).
    """
    repeats = np.maximum(tokens_seen / unique_tokens - 1.0, 0.0)
    eff = unique_tokens + unique_tokens * r_star * -np.expm1(-repeats / r_star)
    return np.where(tokens_seen <= unique_tokens, tokens_seen, eff)


def effective_tokens(tokens_seen: float, unique_tokens: float, r_star: float = R_D_STAR) -> float:
    """Tokens of fresh data that `tokens_seen` tokens drawn from `unique_tokens` are worth.

    Muennighoff et al. 2023, eq. 5: with U_D = unique tokens and R_D = tokens_seen / U_D - 1
    repetitions, D' = U_D + U_D * R_D* * (1 - exp(-R_D / R_D*)). R_D* = 15.4 (their fit,
    15.387756). Limits: one epoch or less gives D' = tokens_seen; infinitely many epochs give
    D' -> U_D * (1 + R_D*). D' is increasing in tokens_seen (derivative exp(-R_D / R_D*) > 0).

    Args: tokens_seen (tokens, >= 0), unique_tokens (tokens, > 0), r_star (repetitions, > 0).
    Returns: effective tokens.
    Raises: TrainplanError on a negative, zero (unique_tokens, r_star) or non-finite input.
    """
    seen = check_non_negative("tokens_seen", tokens_seen)
    unique = check_positive("unique_tokens", unique_tokens)
    r = check_positive("r_star", r_star)
    return float(effective_array(np.asarray(seen), unique, r))


def effective_params(n_params: float, optimal_params: float, r_star: float = R_N_STAR) -> float:
    """Parameters that `n_params` are worth when the compute-optimal size for the unique data is
    `optimal_params` (U_N): excess parameters decay like repeated data.

    Muennighoff et al. 2023, eq. 6: R_N = n_params / U_N - 1, N' = U_N + U_N R_N* (1 -
    exp(-R_N / R_N*)), R_N* = 5.3 (their fit, 5.309743). At or below U_N, N' = n_params.
    Not applied by `LossLaw.predict` (which would need U_N from the law's compute-optimal
    frontier); exposed for the planner's data-constrained mode.

    Args: n_params (parameters, >= 0), optimal_params (parameters, > 0), r_star (> 0).
    Returns: effective parameters.
    Raises: TrainplanError on a bad input.
    """
    n = check_non_negative("n_params", n_params)
    u = check_positive("optimal_params", optimal_params)
    r = check_positive("r_star", r_star)
    return float(effective_array(np.asarray(n), u, r))


@dataclass(frozen=True, kw_only=True, slots=True)
class LossLaw:
    """L(N, D) = E + A / N**alpha + B / D**beta (Hoffmann et al. 2022, eq. 2), with D replaced
    by Muennighoff et al. 2023's effective data D' when the unique data is limited.

    Loss is in nats per token for the tokenizer and corpus the law was fitted on; absolute values
    do not transfer across tokenizers, so the local law is refit from pilot runs (`fit`).
    Defaults are the Besiroglu et al. 2024 refit (see `besiroglu2024`).
    """

    E: float = 1.8172
    """Irreducible loss, nats per token. Besiroglu et al. 2024."""
    A: float = 482.01
    """Model-size coefficient, nats per token times parameters**alpha. 0 when a fit on a single
    model size folded the size term into E."""
    B: float = 2085.43
    """Data coefficient, nats per token times tokens**beta. 0 when a fit on a single token count
    folded the data term into E."""
    alpha: float = 0.3478
    """Model-size exponent, dimensionless."""
    beta: float = 0.3658
    """Data exponent, dimensionless."""
    r_d_star: float = R_D_STAR
    """Repetitions of the unique data at which a repeated token is worth 1/e of a fresh one
    (Muennighoff et al. 2023, eq. 5)."""
    r_n_star: float = R_N_STAR
    """The same decay constant for excess parameters (Muennighoff et al. 2023, eq. 6)."""
    units: str = "nats/token"
    """Loss unit: nats per token of the fitting tokenizer; not comparable across tokenizers."""
    source: str = "Besiroglu et al. 2024 (arXiv:2404.10102), refit of Hoffmann et al. 2022 Approach 3"
    """Where the constants come from."""
    bits: BitsPenalty | None = None
    """Loss penalties of lower-precision settings fitted with this law (`trainplan calibrate`,
    `costmodels.loss.bits`); None: the published defaults (`costmodels.loss.bits.DEFAULT_BITS_PENALTY`)."""

    FIT_NAMES: ClassVar[tuple[str, ...]] = _FIT_NAMES

    def __post_init__(self) -> None:
        check_non_negative("LossLaw.E", self.E)
        check_non_negative("LossLaw.A", self.A)
        check_non_negative("LossLaw.B", self.B)
        check_non_negative("LossLaw.alpha", self.alpha)
        check_non_negative("LossLaw.beta", self.beta)
        check_positive("LossLaw.r_d_star", self.r_d_star)
        check_positive("LossLaw.r_n_star", self.r_n_star)

    @classmethod
    def besiroglu2024(cls) -> LossLaw:
        """Besiroglu et al. 2024 (arXiv:2404.10102) refit of Hoffmann et al. 2022 Approach 3:
        E=1.8172, A=482.01, B=2085.43, alpha=0.3478, beta=0.3658 (nats/token, MassiveText
        tokenizer). Their fit converged; Hoffmann's reported constants did not fit the data."""
        return cls()

    @classmethod
    def hoffmann2022(cls) -> LossLaw:
        """Hoffmann et al. 2022 (arXiv:2203.15556), Sec. 3.3 / App. D.2, constants as printed in
        the paper (rounded): E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28 (nats/token)."""
        return cls(
            E=1.69,
            A=406.4,
            B=410.7,
            alpha=0.34,
            beta=0.28,
            source="Hoffmann et al. 2022 (arXiv:2203.15556), Sec. 3.3, rounded constants",
        )

    def predict(
        self,
        n_params: float,
        tokens_seen: float,
        unique_tokens: float | None = None,
        quality: float = 1.0,
    ) -> float:
        """Predicted final loss in nats per token.

        L = E + A / N**alpha + B / (quality * D')**beta (Hoffmann et al. 2022, eq. 2), where D' is
        `effective_tokens(tokens_seen, unique_tokens, r_d_star)` (Muennighoff et al. 2023, eq. 5)
        when `unique_tokens` is given, else `tokens_seen`. `quality` multiplies the effective
        data: > 1 for a selected subset whose tokens are worth more than average ones. It is a
        modelling assumption (not from a paper) and is fitted from pilot runs by calibration.

        Args: n_params (parameters, > 0), tokens_seen (tokens, > 0), unique_tokens (tokens, > 0,
        or None for unlimited data), quality (dimensionless, > 0).
        Returns: loss, nats per token.
        Raises: TrainplanError on a non-positive or non-finite input.
        """
        n = check_positive("n_params", n_params)
        d = check_positive("tokens_seen", tokens_seen)
        q = check_positive("quality", quality)
        if unique_tokens is not None:
            d = effective_tokens(d, check_positive("unique_tokens", unique_tokens), self.r_d_star)
        return float(self.E + self.A / n**self.alpha + self.B / (q * d) ** self.beta)

    @classmethod
    def fit(
        cls,
        n_params: np.ndarray,
        tokens: np.ndarray,
        losses: np.ndarray,
        *,
        fix: dict[str, float] | None = None,
    ) -> LossLaw:
        """Fit E, A, B, alpha, beta to measured final losses.

        Method of Hoffmann et al. 2022, Sec. 3.3 eq. 3, as corrected by Besiroglu et al. 2024:
        minimise the *sum* of Huber(delta=1e-3) losses of log(predicted) - log(observed) with
        L-BFGS-B, over log E, log A, log B, alpha, beta. Starting points: for a grid of
        (alpha, beta) in [0.05, 2] the law is linear in (E, A, B), solved by non-negative least
        squares; the best ten grid points seed L-BFGS-B, the best optimum wins.

        `tokens` are the (effective) tokens each run trained on; convert repeated data with
        `effective_tokens` first. `fix` pins parameters by name ("E", "A", "B", "alpha",
        "beta"), e.g. fit only E, B, beta with A and alpha pinned.

        Identifiability: when all `n_params` are equal, A / N**alpha is one constant that cannot
        be told apart from E. Unless both A and alpha are pinned, it is folded into E (the result
        has A = 0, so it predicts only at that size) and a UserWarning says so. The same holds
        for B / D**beta when all `tokens` are equal. If E is pinned, pin A or alpha instead.

        Args: n_params (parameters), tokens (tokens), losses (nats/token): 1-D, equal length,
        positive and finite; at least as many points as free parameters.
        Returns: the fitted LossLaw (other fields at their defaults).
        Raises: TrainplanError on bad arrays, an unknown `fix` name, too few points or an
        unidentifiable pinned set.
        """
        n, d, loss = check_fit_arrays(n_params, tokens, losses)
        pinned = dict(fix or {})
        for key, value in pinned.items():
            if key not in _FIT_NAMES:
                raise TrainplanError(f"fix has unknown name {key!r}; valid names: {list(_FIT_NAMES)}")
            pinned[key] = check_finite(f"fix[{key!r}]", value)
        notes = []
        for coef, expo, axis, values in (("A", "alpha", "n_params", n), ("B", "beta", "tokens", d)):
            if np.all(values == values[0]) and not (coef in pinned and expo in pinned):
                if "E" in pinned and coef not in pinned and expo not in pinned:
                    raise TrainplanError(
                        f"all {axis} equal ({values[0]:.4g}) and E is pinned: {coef} and {expo} "
                        f"cannot both be fitted; pin one of them"
                    )
                if "E" not in pinned:
                    pinned[coef] = 0.0
                    pinned.setdefault(expo, getattr(cls(), expo))
                    notes.append(f"{coef}/{axis}^{expo} folded into E (all {axis} = {values[0]:.4g})")
        free = [k for k in _FIT_NAMES if k not in pinned]
        if len(loss) < len(free):
            raise TrainplanError(
                f"fit needs at least {len(free)} points for free parameters {free}, got {len(loss)}"
            )
        if notes:
            warnings.warn(
                "LossLaw.fit: " + "; ".join(notes) + ": the fitted law does not extrapolate along "
                "that axis",
                UserWarning,
                stacklevel=2,
            )
        fitted = huber_fit(n, d, loss, pinned, free)
        src = f"fit to {len(loss)} runs (Huber delta={HUBER_DELTA}, log space)"
        if notes:
            src += "; " + "; ".join(notes)
        return cls(E=fitted["E"], A=fitted["A"], B=fitted["B"], alpha=fitted["alpha"], beta=fitted["beta"],
                   source=src)


def learning_curve(
    tokens: ArrayLike,
    *,
    law: LossLaw,
    n_params: float,
    unique_tokens: float | None = None,
    quality: float = 1.0,
) -> np.ndarray:
    """Predicted loss (nats/token) after each entry of `tokens` (tokens seen so far, > 0).

    Same formula as `LossLaw.predict` (Hoffmann et al. 2022, eq. 2 with Muennighoff et al. 2023
    eq. 5 effective data), applied along a run. Treats each point as the end of a run of that
    length, which ignores the learning-rate schedule: a cosine run is above this curve mid-run
    and meets it at the end (Hoffmann et al. 2022, Sec. 3.1 / Fig. A1).

    Returns: array of the same shape as `tokens`, nats per token.
    Raises: TrainplanError on a non-positive or non-finite token count or bad scalar input.
    """
    t = np.asarray(tokens, dtype=float)
    if t.size and (not np.all(np.isfinite(t)) or np.any(t <= 0)):
        raise TrainplanError(f"tokens must be positive and finite, got min {t.min()!r}")
    n = check_positive("n_params", n_params)
    q = check_positive("quality", quality)
    d = t
    if unique_tokens is not None:
        d = effective_array(t, check_positive("unique_tokens", unique_tokens), law.r_d_star)
    return law.E + law.A / n**law.alpha + law.B / (q * d) ** law.beta

