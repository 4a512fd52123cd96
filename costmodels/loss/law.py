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

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from numpy.typing import ArrayLike

from trainplan.costmodels.checks import check_finite, check_non_negative, check_positive
from trainplan.costmodels.loss.batch import batch_efficiency, critical_batch_tokens
from trainplan.costmodels.loss.bits import BitsPenalty
from trainplan.costmodels.loss.bounds import clamp, decades_outside, is_bound, soft_ceiling, widen_band
from trainplan.costmodels.loss.fit import HUBER_DELTA, check_fit_arrays, huber_fit
from trainplan.costmodels.loss.repetition import R_D_STAR, R_N_STAR, effective_array, effective_tokens
from trainplan.costmodels.loss.transfer import MASSIVETEXT_BYTES_PER_TOKEN, carry_law
from trainplan.errors import TrainplanError

_FIT_NAMES = ("E", "A", "B", "alpha", "beta")

#: Hoffmann et al. 2022, Sec. 3 / Fig. 1: "over 400 language models ranging from 70 million to
#: over 16 billion parameters on 5 to 500 billion tokens": the range the published constants
#: (and Besiroglu et al.'s refit of the same runs) were fitted on.
CHINCHILLA_PARAMS_RANGE = (7e7, 1.6e10)
CHINCHILLA_TOKENS_RANGE = (5e9, 5e11)

Regime = str
LOCAL, PUBLISHED, EXTRAPOLATED = "fitted locally", "published, inside its range", "extrapolated"
BOUND = "a bound near ln(V), not a prediction"
"""The regimes a prediction is in (`LossLaw.regime`); `BOUND`: the law's own value is in the soft
ceiling's region (`trainplan.costmodels.loss.bounds`)."""


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
    `trainplan.costmodels.loss.bits`); None: the published defaults
    (`trainplan.costmodels.loss.bits.DEFAULT_BITS_PENALTY`)."""
    bytes_per_token: float = MASSIVETEXT_BYTES_PER_TOKEN
    """UTF-8 bytes per token of the data the constants are in (`trainplan.costmodels.loss.transfer`):
    MassiveText's for the published laws, the local corpus's once carried or fitted."""
    vocab_size: int | None = None
    """The model's vocabulary: no prediction is above ln(vocab_size), the loss of a uniform
    guess (a model that learned nothing). None: no bound."""
    b_crit_tokens: float | None = None
    """Critical batch in tokens (`trainplan.costmodels.loss.batch`), fitted locally; None: Kaplan et
    al. 2020's B_crit(L) at the predicted loss, carried per byte."""
    params_range: tuple[float, float] | None = CHINCHILLA_PARAMS_RANGE
    """Parameters the constants were fitted over (None: not recorded)."""
    tokens_range: tuple[float, float] | None = CHINCHILLA_TOKENS_RANGE
    """Tokens (of this law's tokenizer) the constants were fitted over (None: not recorded)."""
    local: bool = False
    """Fitted on runs of this model, tokenizer and corpus (pilots or `trainplan calibrate`)."""
    band_nats: float = 0.0
    """Half-width of the law's band around a prediction, nats/token, for a local fit (its
    residuals); a published law's band is `published_band` at each point."""

    cooldown_gain: float = 0.0
    """Share of the excess loss over the floor that the run's cooldown removes (the pilots' gamma,
    `trainplan.costmodels.loss.pilots.fit_pilot_law`; in [0, 1)). `predict` already gives final
    losses (B is the after-cooldown coefficient); this is what the run's own online forecast
    takes off its constant-rate curve (`trainplan.costmodels.loss.online`). 0: not measured."""

    FIT_NAMES: ClassVar[tuple[str, ...]] = _FIT_NAMES

    def __post_init__(self) -> None:
        check_non_negative("LossLaw.E", self.E)
        check_non_negative("LossLaw.A", self.A)
        check_non_negative("LossLaw.B", self.B)
        check_non_negative("LossLaw.alpha", self.alpha)
        check_non_negative("LossLaw.beta", self.beta)
        check_positive("LossLaw.r_d_star", self.r_d_star)
        check_positive("LossLaw.r_n_star", self.r_n_star)
        check_positive("LossLaw.bytes_per_token", self.bytes_per_token)
        check_non_negative("LossLaw.band_nats", self.band_nats)
        if not 0.0 <= check_non_negative("LossLaw.cooldown_gain", self.cooldown_gain) < 1.0:
            raise TrainplanError(f"LossLaw.cooldown_gain must be in [0, 1), got {self.cooldown_gain!r}")
        if self.b_crit_tokens is not None:
            check_positive("LossLaw.b_crit_tokens", self.b_crit_tokens)
        if self.vocab_size is not None and (isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int)
                                            or self.vocab_size < 2):
            raise TrainplanError(f"LossLaw.vocab_size must be a whole number >= 2 or None, got {self.vocab_size!r}")

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
        *,
        batch_tokens: float | None = None,
        warmup_tokens: float = 0.0,
        bounded: bool = True,
    ) -> float:
        """Predicted final loss in nats per token, below ln(vocab_size).

        L = E + A / N**alpha + B / X**beta (Hoffmann et al. 2022, eq. 2) with X the tokens that
        count:
        - repeated data: D' = `effective_tokens(tokens_seen, unique_tokens, r_d_star)`
          (Muennighoff et al. 2023, eq. 5) when `unique_tokens` is given, else `tokens_seen`;
        - warmup: a linear warmup over `warmup_tokens` moves the weights half as far as at the
          peak rate, so half of it is taken off (the learning rate's area, Tissue et al. 2024,
          "Scaling Law with Learning Rate Annealing", arXiv:2408.11029, whose loss falls with the
          summed learning rate);
        - batch: times E_min / E = 1 / (1 + B / B_crit) at `batch_tokens` per optimizer step
          (Kaplan et al. 2020 Sec. 5.1, `trainplan.costmodels.loss.batch`): B_crit is `b_crit_tokens`, or
          Kaplan's B_crit(L) at the predicted loss (a fixed point, found in a few iterations:
          B_crit grows as L falls);
        - `quality` multiplies X: > 1 for a selected subset whose tokens are worth more than
          average ones (a modelling assumption, fitted from pilot runs by calibration).
        Then, when `bounded`, the soft ceiling under ln(vocab_size)
        (`trainplan.costmodels.loss.bounds.soft_ceiling`: unchanged below 0.9 ln V, strictly
        decreasing in the tokens above); False: the law's own value (`regime` tells a bound).

        Args: n_params (parameters, > 0), tokens_seen (tokens, > 0), unique_tokens (tokens, > 0,
        or None for unlimited data), quality (> 0), batch_tokens (tokens per optimizer step,
        > 0, or None: no batch term), warmup_tokens (tokens, >= 0).
        Returns: loss, nats per token.
        Raises: TrainplanError on a non-positive or non-finite input.
        """
        n = check_positive("n_params", n_params)
        d = check_positive("tokens_seen", tokens_seen)
        q = check_positive("quality", quality)
        w = check_non_negative("warmup_tokens", warmup_tokens)
        x = d
        if unique_tokens is not None:
            x = effective_tokens(d, check_positive("unique_tokens", unique_tokens), self.r_d_star)
        x *= max(d - 0.5 * min(w, d), 1.0) / d
        base = self.E + self.A / n**self.alpha
        loss = base + self.B / (q * x) ** self.beta
        if batch_tokens is not None:
            g = check_positive("batch_tokens", batch_tokens)
            for _ in range(1 if self.b_crit_tokens is not None else 4):
                b_crit = self.b_crit_tokens or critical_batch_tokens(
                    min(loss, self.ceiling), bytes_per_token=self.bytes_per_token)
                loss = base + self.B / (q * x * batch_efficiency(g, b_crit)) ** self.beta
        return float(soft_ceiling(loss, self.ceiling)) if bounded else float(loss)

    @property
    def ceiling(self) -> float:
        """ln(vocab_size), nats per token: the uniform guess's loss; inf without a vocabulary."""
        return math.log(self.vocab_size) if self.vocab_size else math.inf

    def regime(self, n_params: float, tokens_seen: float, raw_loss: float | None = None) -> Regime:
        """Which regime a prediction at (n_params, tokens_seen) is in: `BOUND` when the law's own
        value `raw_loss` (`predict(..., bounded=False)`, if given) is in the soft ceiling's
        region; else `LOCAL` (fitted on this model, tokenizer and corpus), `PUBLISHED` (a
        published law inside the parameters and tokens it was fitted over) or `EXTRAPOLATED`
        (outside them, or no range recorded)."""
        if raw_loss is not None and is_bound(raw_loss, self.ceiling):
            return BOUND
        if self.local:
            return LOCAL
        inside = all(rng is not None and rng[0] <= v <= rng[1]
                     for rng, v in ((self.params_range, n_params), (self.tokens_range, tokens_seen)))
        return PUBLISHED if inside else EXTRAPOLATED

    def band(self, n_params: float, tokens_seen: float, unique_tokens: float | None = None, **kw) -> float:
        """Half-width of the prediction's band, nats/token: `band_nats` for a local law; for a
        published one the spread between the two published fits of Hoffmann et al.'s runs at
        this point (Hoffmann et al. 2022's constants against Besiroglu et al. 2024's refit, each
        carried to this law's bytes per token and vocabulary), at least 1% of the prediction;
        outside the fitted ranges widened by the decades outside
        (`trainplan.costmodels.loss.bounds.widen_band`). `kw`: `predict`'s keywords."""
        if self.local:
            return self.band_nats
        other = carry_law(dataclasses.replace(LossLaw.hoffmann2022(), vocab_size=self.vocab_size,
                                              b_crit_tokens=self.b_crit_tokens), self.bytes_per_token)

        def spread(n: float, d: float) -> float:
            mine = self.predict(n, d, unique_tokens, **kw)
            return max(abs(other.predict(n, d, unique_tokens, **kw) - mine), 0.01 * mine)

        here = spread(n_params, tokens_seen)
        decades = (decades_outside(n_params, self.params_range) + decades_outside(tokens_seen, self.tokens_range))
        edge = spread(clamp(n_params, self.params_range), clamp(tokens_seen, self.tokens_range)) if decades else here
        return widen_band(here, edge, decades)

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
    bounded: bool = True,
) -> np.ndarray:
    """Predicted loss (nats/token) after each entry of `tokens` (tokens seen so far, > 0).

    `bounded`: under ln(vocab_size)'s soft ceiling, as `LossLaw.predict`; False: the law's own curve, for its
    shape (the compute governor's stop is where its drop per step crosses a threshold: a curve
    clipped flat at ln(V) would stop every run at once).

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
    curve = law.E + law.A / n**law.alpha + law.B / (q * d) ** law.beta
    return soft_ceiling(curve, law.ceiling) if bounded else curve

