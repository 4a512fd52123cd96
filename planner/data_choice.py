"""The data subset's scoring method, chosen with its kept fraction after the joint solve.

The joint solver (`trainplan.planner.joint.solver`) picks every knob for a random subset: its loss table is the
data-constrained law at each token level and kept fraction. A scoring method changes two numbers
of that table, and nothing else the solver sees (memory, step time, the combo): the data term's
quality multiplier and the tokens left once the scoring is paid for. So, at the solved knobs,
`choose_data_method` re-evaluates every (method, fraction) pair of the fraction grid:

    S      = the plan's steps (the whole budget at its knobs) + the steps its method was charged
    c(m)   = ceil(scoring_flops(m) / (flops_per_step * devices))        steps the scoring costs
    L(m,f) = law.predict(N, (S - c(m)) * tokens_per_step, unique = f * D, quality = q_m(f))
             + bits penalty

and keeps the lowest L; ties go to random, then to the larger fraction. A non-random method wins
exactly when its predicted gain (quality > 1) beats its scoring cost (fewer steps).

Sources: the law and effective data are Muennighoff et al. 2023 ("Scaling Data-Constrained
Language Models", arXiv:2305.16264, eq. 5) on Hoffmann et al. 2022's form (`trainplan.costmodels.loss.law`);
q_m(f) = 1 + a (1 - f)**b is `trainplan.costmodels.data.quality`'s selection-quality multiplier; charging the
scoring compute to the budget follows Yin and Rush 2025 ("Compute-Constrained Data Selection",
arXiv:2410.16208), with the FLOPs of the executor's default reference model predicted by
`trainplan.costmodels.data.scoring.reference_scoring_flops` over every corpus window plus `TARGET_WINDOWS`
target windows, converted to steps at the plan's FLOPs per step (under a time budget the same
conversion at the plan's FLOP rate).

Which multiplier a method gets (`known_quality`), first that applies:
1. `fits` passed in (e.g. from `trainplan.costmodels.data.fit.fit_quality` on pilot runs);
2. a local fit cached for (model, vocabulary) (`trainplan.costmodels.data.quality_cache.load_quality_fits`,
   written by `save_quality_fits` or `python benchmarks/data.py --save-fits`);
3. the published default (`DEFAULT_QUALITY`) for models of at least `LARGE_MODEL_PARAMS`
   parameters: Ankner et al. 2024 ("Perplexed by Perplexity", arXiv:2405.20541) measured loss-
   based pruning at 1B-3B (q(0.5) = 1.45); influence and DSIR have no published pretraining-loss
   multiplier (q = 1), so they never pay for scoring on a default;
4. otherwise the method is not a candidate (a smaller model's gain is unknown: Goyal et al. 2024,
   "Scaling Laws for Data Filtering", arXiv:2404.07177, find a subset's value depends on scale).

Approximations: the knobs (combo, checkpointing, optimizer width) stay the solver's; only
tokens and fraction move, which is exact for every knob but the optimizer width, whose loss
penalty the solver traded against tokens at the random subset's quality. The published loss
multiplier was measured with a 125M reference model; the executor's default reference is far
smaller (`trainplan.executor.data.scorers.ReferenceConfig`), so refit it locally before trusting it. With no
corpus size (`data_tokens` unconstrained) there is no pool to score and the plan stays random.
Dynamic selection (`Decisions.selection_every_steps`) is never chosen here (no multiplier model
for it); `with_data_method` sets it by hand and predicts it at the random subset's quality.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from trainplan.costmodels.data.quality import DEFAULT_QUALITY, METHODS, QualityFit
from trainplan.costmodels.data.quality_cache import load_quality_fits
from trainplan.costmodels.data.scoring import reference_scoring_flops
from trainplan.costmodels.loss.bits import bits_loss_penalty
from trainplan.costmodels.loss.cache import law_from_fields, load_local_law
from trainplan.costmodels.loss.law import LossLaw
from trainplan.costmodels.loss.planned import run_loss, warmup_steps_for
from trainplan.errors import TrainplanError
from trainplan.planner.budget import UNLIMITED_DATA_TOKENS
from trainplan.planner.options import DEFAULT_DATA_METHODS
from trainplan.planner.plan import Plan

__all__ = ["LARGE_MODEL_PARAMS", "TARGET_WINDOWS", "DataOption",
           "check_data_methods", "known_quality", "predicted_scoring_flops", "data_options",
           "choose_data_method", "with_data_method", "plan_law"]

LARGE_MODEL_PARAMS = 1e9
"""From this many parameters a method without a local fit gets its published default multiplier
(Ankner et al. 2024 trained 1B and 3B models)."""
TARGET_WINDOWS = 64
"""Held-out target windows influence/DSIR also score; mirrors `trainplan.executor.data.dynamic_selection.TARGET_WINDOWS`
(the planner does not import the executor)."""


def check_data_methods(methods) -> tuple[str, ...]:
    """`methods` as a tuple with "random" first (always a candidate: the solver's own plan).

    Raises: TrainplanError on an empty list or an unknown method."""
    if isinstance(methods, str):
        methods = [m.strip() for m in methods.split(",") if m.strip()]
    methods = tuple(methods or ())
    bad = [m for m in methods if m not in METHODS]
    if not methods or bad:
        raise TrainplanError(f"data methods {list(methods)!r}: "
                             f"{'unknown ' + ', '.join(map(repr, bad)) if bad else 'none given'}; "
                             f"known: {', '.join(METHODS)}")
    return tuple(dict.fromkeys(("random",) + methods))


def known_quality(model: str, vocab_size: int, n_params: float, methods: Sequence[str], *,
                  fits: dict[str, QualityFit] | None = None, cache_dir=None
                  ) -> dict[str, QualityFit]:
    """The quality multiplier of each of `methods` that has one (module docstring, rules 1-4);
    "random" always (q = 1)."""
    cached = load_quality_fits(model, vocab_size, cache_dir) if model else {}
    out = {}
    for m in check_data_methods(methods):
        if fits and m in fits:
            out[m] = fits[m]
        elif m == "random":
            out[m] = DEFAULT_QUALITY["random"]
        elif m in cached:
            out[m] = cached[m]
        elif n_params >= LARGE_MODEL_PARAMS:
            out[m] = DEFAULT_QUALITY[m]
    return out


def plan_law(plan: Plan) -> LossLaw:
    """The law `trainplan.planner.api.solve` predicted `plan` with: the one the plan records
    (`Predictions.loss_law`); for plans written before it, the locally fitted law of (model,
    vocabulary) on the cpu profile when one is cached, else Besiroglu et al. 2024's."""
    if plan.predictions.loss_law:  # the law the plan was predicted with (plans since the field)
        return law_from_fields(plan.predictions.loss_law)
    if plan.hw == "cpu":
        law = load_local_law(plan.model, plan.vocab_size)
        if law is not None:
            return law
    return LossLaw.besiroglu2024()


def predicted_scoring_flops(plan: Plan, method: str, every: int = 0) -> float:
    """FLOPs scoring the plan's corpus with `method` costs, before any scoring ran.

    Static (`every` 0): `reference_scoring_flops` of the executor's default reference over every
    corpus window ((data_tokens - 1) // seq_len) plus `TARGET_WINDOWS`. Dynamic (K = `every`):
    the trained model scores every window at each multiple of K after step 0: per re-score a
    forward (2 N per token, from the plan's model FLOPs per token / 3) for "loss", twice that
    for "influence" (plus a backward; the projection is left out), 4 per token for "dsir"."""
    d = plan.decisions
    n_windows = max(1, (int(plan.data_tokens) - 1) // d.seq_len)
    if method == "random":
        return 0.0
    if every == 0:
        return reference_scoring_flops(method, n_windows, d.seq_len, plan.vocab_size,
                                       target_windows=TARGET_WINDOWS).total
    p = plan.predictions
    rescores = max(0, (d.max_steps - 1) // every)
    tokens = float(n_windows) * d.seq_len * rescores
    fwd_per_token = p.model_flops_per_step * d.devices / max(1, p.tokens_per_step) / 3.0
    per_token = {"loss": fwd_per_token, "influence": 2.0 * fwd_per_token, "dsir": 4.0}[method]
    return per_token * tokens


@dataclass(frozen=True, kw_only=True, slots=True)
class DataOption:
    """One (method, fraction) candidate at the solved knobs."""

    method: str
    fraction: float
    quality: float
    """q_m(fraction), dimensionless."""
    quality_source: str
    scoring_flops: float
    scoring_steps: int
    """Training steps the scoring costs (ceil of its FLOPs over one step's)."""
    steps: int
    """Training steps left."""
    predicted_loss: float
    """Final held-out loss, nats/token (law x quality, plus the optimizer bits penalty)."""


def _budget_steps(plan: Plan) -> tuple[int, float]:
    """(steps the whole budget buys at the plan's knobs, FLOPs of one step over all devices):
    the plan's steps plus those its current method was charged."""
    p, d = plan.predictions, plan.decisions
    step_flops = p.flops_per_step * d.devices
    charged = math.ceil(p.scoring_flops / step_flops) if p.scoring_flops > 0 else 0
    return d.max_steps + charged, step_flops


def data_options(plan: Plan, law: LossLaw | None = None, *,
                 methods: Sequence[str] = DEFAULT_DATA_METHODS,
                 fractions: Sequence[float] = (0.25, 0.5, 0.75, 1.0),
                 fits: dict[str, QualityFit] | None = None, cache_dir=None) -> list[DataOption]:
    """Every affordable (method, fraction) at the plan's knobs with its predicted loss, best
    first (module docstring). Fraction 1 is random's only (keeping all after scoring is the same
    data with fewer steps); an option whose scoring costs the whole budget is left out."""
    law = law or plan_law(plan)
    d = plan.decisions
    total, step_flops = _budget_steps(plan)
    tps = plan.predictions.tokens_per_step
    pen = bits_loss_penalty(d.optimizer_bits, d.activation_bits, precision=d.precision, penalty=law.bits)
    quality = known_quality(plan.model, plan.vocab_size, plan.law_n_params, methods, fits=fits,
                            cache_dir=cache_dir)
    out = []
    for m, fit in quality.items():
        flops = predicted_scoring_flops(plan, m)
        charge = math.ceil(flops / step_flops) if flops > 0 else 0
        steps = total - charge
        if steps < 1:
            continue
        for f in sorted({float(x) for x in fractions}):
            if not 0.0 < f <= 1.0:
                raise TrainplanError(f"data fraction {f!r} must be in (0, 1]")
            if f == 1.0 and m != "random":
                continue
            q = fit.q(f)
            loss = run_loss(law, plan.law_n_params, steps=steps, tokens_per_step=tps,
                            unique_tokens=max(1.0, f * plan.data_tokens), quality=q) + pen
            out.append(DataOption(method=m, fraction=f, quality=q, quality_source=fit.source,
                                  scoring_flops=flops, scoring_steps=charge, steps=steps,
                                  predicted_loss=loss))
    out.sort(key=lambda o: (o.predicted_loss, o.method != "random", -o.fraction))
    return out


def _apply(plan: Plan, o: DataOption, note: str) -> Plan:
    d, p = plan.decisions, plan.predictions
    tps = p.tokens_per_step
    decisions = dataclasses.replace(d, data_method=o.method, data_fraction=o.fraction,
                                    max_steps=o.steps, max_tokens=o.steps * tps,
                                    warmup_steps=warmup_steps_for(o.steps))
    predictions = dataclasses.replace(
        p, total_tokens=o.steps * tps, device_hours=p.step_time_s * o.steps * d.devices / 3600.0,
        final_loss=o.predicted_loss, scoring_flops=o.scoring_flops)
    return dataclasses.replace(plan, decisions=decisions, predictions=predictions,
                               notes=tuple(plan.notes) + (note,))


def choose_data_method(plan: Plan, law: LossLaw | None = None, *,
                       methods: Sequence[str] = DEFAULT_DATA_METHODS,
                       fractions: Sequence[float] = (0.25, 0.5, 0.75, 1.0),
                       fits: dict[str, QualityFit] | None = None, cache_dir=None) -> Plan:
    """`plan` with its data method and fraction chosen jointly (module docstring), steps and
    tokens re-derived from what the scoring leaves of the budget. Unchanged when only "random"
    is asked for, when random wins (the solver's own plan), with no corpus size, or for a plan
    with dynamic selection. Call it before `trainplan.planner.governor.with_governor` (whose predictions
    it would not update). Idempotent: a plan already charged for a method is re-evaluated from
    its whole budget.

    law: the plan's loss law (default `plan_law(plan)`, what `solve` uses).
    fits: quality multipliers that override the cached and default ones, by method.

    Raises: TrainplanError on an unknown method or a fraction outside (0, 1].
    """
    methods = check_data_methods(methods)
    d = plan.decisions
    if (methods == ("random",) and d.data_method == "random") or d.selection_every_steps > 0 \
            or plan.data_tokens >= UNLIMITED_DATA_TOKENS:
        return plan
    options = data_options(plan, law, methods=methods, fractions=fractions, fits=fits,
                           cache_dir=cache_dir)
    if not options:
        return plan
    best = options[0]
    if best.method == "random" and d.data_method == "random":
        return plan
    rand = next((o for o in options if o.method == "random"), None)
    versus = (f"; best random subset (f={rand.fraction:g}) {rand.predicted_loss:.4f}"
              if rand is not None else "")
    note = (f"data: {best.method} at fraction {best.fraction:g} (q={best.quality:.3g}: "
            f"{best.quality_source}); scoring {best.scoring_flops:.3g} FLOPs = "
            f"{best.scoring_steps} steps charged; predicted loss {best.predicted_loss:.4f}"
            f"{versus} (trainplan.planner.data_choice)")
    return _apply(plan, best, note)


def with_data_method(plan: Plan, method: str, *, selection_every_steps: int = 0,
                     law: LossLaw | None = None, fits: dict[str, QualityFit] | None = None,
                     cache_dir=None) -> Plan:
    """`plan` with `method` (and dynamic selection every `selection_every_steps` steps) set by
    hand at its own fraction and steps (`trainplan.planner.api.plan_for_choice`: steps fixed by the
    caller, so nothing is taken off them): the scoring FLOPs predicted and the final loss
    predicted at the method's known multiplier (q = 1 when it has none, and for dynamic
    selection).

    Raises: TrainplanError on an unknown method or a negative `selection_every_steps`.
    """
    check_data_methods([method])
    every = selection_every_steps
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise TrainplanError(f"selection_every_steps={every!r} must be a whole number >= 0")
    d, p = plan.decisions, plan.predictions
    law = law or plan_law(plan)
    fit = known_quality(plan.model, plan.vocab_size, plan.law_n_params, [method], fits=fits,
                        cache_dir=cache_dir).get(method, DEFAULT_QUALITY["random"])
    q = fit.q(d.data_fraction) if every == 0 else 1.0
    loss = run_loss(law, plan.law_n_params, steps=d.max_steps, tokens_per_step=p.tokens_per_step,
                    unique_tokens=max(1.0, d.data_fraction * plan.data_tokens), quality=q,
                    warmup_steps=d.warmup_steps)
    flops = predicted_scoring_flops(plan, method, every) if d.data_fraction < 1.0 else 0.0
    decisions = dataclasses.replace(d, data_method=method, selection_every_steps=every)
    pen = bits_loss_penalty(d.optimizer_bits, d.activation_bits, precision=d.precision, penalty=law.bits)
    predictions = dataclasses.replace(p, final_loss=loss + pen,
                                      scoring_flops=flops)
    return dataclasses.replace(plan, decisions=decisions, predictions=predictions)
