"""What a smaller, better-scored data subset is worth, and what scoring it costs.

Pure (numpy/scipy, no torch): the planner builds its loss table from these functions and charges
the scoring compute to the budget; `trainplan.executor.data.selection` does the scoring and reports the FLOPs it
counted, which `scoring_flops` predicts.

Loss of a run on a selected subset (nats per token):

    L = E + A / N**alpha + B / (q(method, f) * D')**beta            (+ offset)

- D' = effective data (Muennighoff et al. 2023, "Scaling Data-Constrained Language Models",
  arXiv:2305.16264, eq. 5): the `tokens_seen` drawn from `unique = f * corpus_tokens` unique tokens,
  repeated epochs decaying with R_D* = 15.4 (`trainplan.costmodels.loss.repetition.effective_tokens`).
- q(method, f) = 1 + a * (1 - f)**b, the *selection-quality multiplier*: how many random tokens one
  selected token is worth. q(1) = 1 (keeping everything is no selection); a > 0 when the method's
  subset beats a random one of the same size (a in (-1, inf), so q > 0). The form is a modelling
  assumption (no paper gives one): it is monotone in f, has the right end point and two
  constants, which `fit_quality` fits per method from pilot runs. It ignores that a subset's
  advantage shrinks as models and budgets grow (Goyal et al. 2024, "Scaling Laws for Data
  Filtering", arXiv:2404.07177): refit per model size.
- Scoring compute is charged to the budget (Yin and Rush 2025, "Compute-Constrained Data
  Selection", arXiv:2410.16208: counting it, perplexity and gradient scoring pay off only when the
  trained model is ~5x resp. ~10x larger than the scoring model); `scoring_flops` gives it.

Defaults: `DEFAULT_QUALITY` holds the published-number defaults used before any local fit
(random: q = 1; loss/perplexity: Ankner et al. 2024; influence and DSIR: q = 1 until fitted, see
there). `fit_local_law` refits E, B, beta of the law on the local machine's small runs.
Fitted multipliers are cached per (model, vocabulary) with `save_quality_fits` (e.g.
`python benchmarks/data.py --save-fits`) and read back by `load_quality_fits`, which the planner's
method choice (`trainplan.planner.data_choice`) prefers to the defaults.

Where each part lives: the loss of a run on a selected subset here (`predicted_loss`,
`subset_loss`); the multiplier q, the method names and `DEFAULT_QUALITY` in
`trainplan.costmodels.data.quality`; the fits in `trainplan.costmodels.data.fit`; scoring compute and the solver's
(method, fraction) menu in `trainplan.costmodels.data.scoring`; the cache of fitted multipliers in
`trainplan.costmodels.data.quality_cache`.
"""

from __future__ import annotations

import numpy as np

from trainplan.costmodels.checks import check_range
from trainplan.costmodels.data.quality import DEFAULT_QUALITY, QualityFit, check_fraction
from trainplan.costmodels.loss.law import LossLaw
from trainplan.costmodels.loss.repetition import effective_array


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
    f = check_fraction(fraction)
    corpus = check_range("corpus_tokens", corpus_tokens, low=0.0)
    unique = max(1.0, f * corpus)
    return predicted_loss(law, n_params, tokens_seen, unique, fit.q(f)) + float(offset)


def subset_loss_curve(law: LossLaw, n_params: float | np.ndarray, tokens: np.ndarray,
                      unique: np.ndarray, q: float | np.ndarray) -> np.ndarray:
    """`predicted_loss` on arrays, without input checks: L = E + A / N**alpha +
    B / (q * D')**beta, D' = `effective_array(tokens, unique, law.r_d_star)` (Muennighoff et al.
    2023 eq. 5), nats per token.

    Args: n_params (parameters, > 0), tokens (tokens seen, > 0), unique (unique tokens, > 0),
    q (selection-quality multiplier, > 0); arrays broadcast together.
    Returns: the loss at each point, the broadcast shape.
    """
    eff = effective_array(tokens, unique, law.r_d_star)
    return law.E + law.A / n_params**law.alpha + law.B / (q * eff) ** law.beta
