"""What a smaller, better-scored data subset is worth, and what scoring it costs.

Pure (numpy/scipy, no torch): the planner builds its loss table from these functions and charges
the scoring compute to the budget; `executor.data.selection` does the scoring and reports the FLOPs it
counted, which `scoring_flops` predicts.

Loss of a run on a selected subset (nats per token):

    L = E + A / N**alpha + B / (q(method, f) * D')**beta            (+ offset)

- D' = effective data (Muennighoff et al. 2023, "Scaling Data-Constrained Language Models",
  arXiv:2305.16264, eq. 5): the `tokens_seen` drawn from `unique = f * corpus_tokens` unique tokens,
  repeated epochs decaying with R_D* = 15.4 (`costmodels.loss.law.effective_tokens`).
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
method choice (`planner.data_choice`) prefers to the defaults.
"""

from __future__ import annotations

# The code lives in four modules beside this one; every name stays importable from here.
from costmodels.data.fit import R_D_STAR_BOUNDS as R_D_STAR_BOUNDS
from costmodels.data.fit import _fit_r_d_star as _fit_r_d_star
from costmodels.data.fit import fit_local_law, fit_quality
from costmodels.data.quality import (
                                     DEFAULT_QUALITY,
                                     METHODS,
                                     QUALITY_FORM,
                                     QualityFit,
                                     predicted_loss,
                                     selection_quality,
                                     subset_loss,
)
from costmodels.data.quality import _curve as _curve
from costmodels.data.quality import _fraction as _fraction
from costmodels.data.quality import _num as _num
from costmodels.data.quality_cache import QUALITY_CACHE_FORMAT as QUALITY_CACHE_FORMAT
from costmodels.data.quality_cache import load_quality_fits, quality_path, save_quality_fits
from costmodels.data.scoring import (
                                     ScoringFlops,
                                     SelectionOption,
                                     reference_scoring_flops,
                                     scoring_flops,
                                     selection_menu,
)

__all__ = ["METHODS", "QUALITY_FORM", "QualityFit", "DEFAULT_QUALITY", "ScoringFlops",
           "SelectionOption", "selection_quality", "predicted_loss", "subset_loss", "fit_quality",
           "fit_local_law", "scoring_flops", "reference_scoring_flops", "selection_menu",
           "quality_path", "save_quality_fits", "load_quality_fits"]
