"""The planner's side of the compute governor: the stopping threshold and the predicted stop.

A plan's budget (`Decisions.max_steps`) is the most the run may spend; the governor
(`trainplan.executor.governor`) ends it earlier when its next steps are no longer worth their cost. The
planner fixes the governor's threshold from economics and predicts where it will stop:

- threshold (nats/token per step) = cost of one step / value of one nat of held-out loss.
  The cost of a step is the plan's own prediction, `step_time_s x devices / 3600`
  device-hours; the value of a nat is the user's (`--loss-value-device-hours-per-nat` on
  `trainplan solve` and `demo`): how many device-hours one nat less held-out loss is worth.
  A step is worth taking while it lowers the loss by at least the threshold
  (`trainplan.costmodels.stopping.prediction.threshold_from_value`).
- predicted stop step: the step at which the governor's own rule (`trainplan.costmodels.stopping.rule.
  Governor`: the same refit cadence, fit window, confidence bound, trend check and cooldown
  rule), run over a predicted held-out curve evaluated as the run will be (every `eval_every`
  steps, with the noise a pilot's held-out curve showed about its fit), decides to stop: the
  median over simulated evaluation series (`trainplan.costmodels.stopping.simulation.simulated_stop_step`).
  The curve is, best, the one calibrated on pilot runs (`curve=`, `trainplan.costmodels.stopping.heldout_curve`:
  a fresh-data law plus a penalty for repeated data, which can rise, as an overfitting run's
  held-out loss does, and the pilots' measured start before their fitted range); without
  one, the plan's loss law along the run (the local law of `trainplan calibrate` on the
  cpu profile, else the published one, data-constrained through Muennighoff et al. 2023's
  effective tokens), which only flattens and so misplaces a stop that overfitting sets; and
  without an evaluation noise either, where the law's mean drop per step crosses the threshold
  (`trainplan.costmodels.stopping.prediction.predict_stop_from_law`), a lower bound on the governor's stop.

`with_governor` returns the plan with both written in (`Decisions.governor_threshold`,
`Predictions.predicted_stop_step`, `predicted_end_step`, `predicted_end_loss`) and a note
saying how. With a pilot curve it can also pick the token budget (`pick_budget=True`): the
steps the governed run is predicted to need, with room for the prediction's error, instead of
the budget's whole reach (the budget stays the ceiling).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from trainplan.costmodels.loss.bits import bits_loss_penalty
from trainplan.costmodels.loss.cache import law_from_fields, load_local_law
from trainplan.costmodels.loss.law import LossLaw, learning_curve
from trainplan.costmodels.stopping.heldout_curve import HeldoutCurve
from trainplan.costmodels.stopping.prediction import predict_stop_from_law, threshold_from_value
from trainplan.costmodels.stopping.schedule import cooldown_steps
from trainplan.costmodels.stopping.simulation import simulated_stops
from trainplan.errors import TrainplanError
from trainplan.planner.plan import Plan

LAW_NOTE = "loss law: "
"""How `trainplan.planner.api` names the plan's loss law in `Plan.notes`."""
GOVERNOR_NOTE = "governor: "
CURVE_NEEDS_VALUE = ("--heldout-curve predicts the governor's stop: give "
                     "--loss-value-device-hours-per-nat V with it")
BUDGET_QUANTILE = 0.9
"""`pick_budget`: the simulated decision this far up the sorted series sets the budget."""
BUDGET_MARGIN = 0.25
"""`pick_budget`: the budget is (1 + this) x the end (stop + cooldown) of that decision. The
largest stop-step error `benchmarks/governor.py` measured with the run deciding later than
predicted (seeds 2 to 10, 36 governed runs) was 20.0% (a late prediction only leaves budget
unused), and the simulated series scatter less than real runs do; 25% covers both."""


def plan_law(plan: Plan, cache_dir=None) -> LossLaw:
    """The loss law the planner used for `plan`: the one it records (`Predictions.loss_law`);
    in plans written before that field, from the source its notes name: the local law of
    (model, vocabulary) when its source matches (cpu plans), else the published law of that
    source.

    Raises:
        TrainplanError: the plan names a law that is neither (a law passed to `solve` by the
            caller): pass it to `with_governor(law=...)`.
    """
    if plan.predictions.loss_law:  # plans since the field carry their law
        return law_from_fields(plan.predictions.loss_law)
    source = next((n[len(LAW_NOTE):] for n in plan.notes if n.startswith(LAW_NOTE)), None)
    candidates = [LossLaw.besiroglu2024(), LossLaw.hoffmann2022()]
    try:
        local = load_local_law(plan.model, plan.vocab_size, cache_dir)
    except TrainplanError:
        local = None
    if local is not None:
        candidates.insert(0, local)
    if source is None:
        return local or LossLaw.besiroglu2024()
    for law in candidates:
        if law.source == source:
            return law
    raise TrainplanError(f"the plan's loss law ({source!r}) is neither the local nor a published "
                         "law: pass it as with_governor(plan, ..., law=LAW)")


def with_governor(plan: Plan, *, value_device_hours_per_nat: float | None = None,
                  threshold_nats_per_step: float | None = None, law: LossLaw | None = None,
                  curve: HeldoutCurve | None = None, noise_nats: float | None = None,
                  eval_every: int | None = None, governor_settings: dict | None = None,
                  runs: int = 16, pick_budget: bool = False, cache_dir=None) -> Plan:
    """`plan` with the compute governor on: its threshold and predicted stop written in.

    Give exactly one of
        value_device_hours_per_nat: device-hours one nat of held-out loss is worth; the
            threshold is then the plan's predicted cost of one step (device-hours) over it;
        threshold_nats_per_step: the threshold itself (0: the governor off, no prediction).
    curve: the held-out curve calibrated on pilot runs (`trainplan.costmodels.stopping.heldout_fit.
        fit_heldout_curve`); it is moved to the plan's tokens per step and unique tokens
        (`HeldoutCurve.for_run`) and the governor simulated over it, its start as the pilots
        measured it (`HeldoutCurve.loss_with_early`), with `noise_nats` (default:
        `curve.sim_noise_nats`, the larger of the fit's RMS residual and the pilots'
        evaluation noise). The predicted end loss is the curve at the end step less the pilots'
        cooldown gain.
    law: without a curve, the loss law to predict the curve with (default: the plan's,
        `plan_law`).
    noise_nats: the held-out evaluation noise expected (nats). With a curve or a noise, the
        predicted stop is the governor's own rule simulated over the curve (`runs` series of
        evaluations every `eval_every` steps, default: a governed run's, max_steps // 50, with
        `governor_settings`, `Governor` fields; `trainplan.costmodels.stopping.simulation.
        simulated_stop_step`): it waits for an upper confidence bound, so it stops later than
        the curve's crossing. Neither: the crossing of the law's mean curve
        (`trainplan.costmodels.stopping.prediction.predict_stop_from_law`), a lower bound on the stop.
    pick_budget: with a simulated stop before the budget, also pick the token budget from the
        curve: max_steps = min(the budget's, ceil((1 + BUDGET_MARGIN) x end)), end = the
        BUDGET_QUANTILE simulated decision plus its cooldown; the stop is then simulated again
        under that budget (a governed run's evaluation period follows max_steps). Without a
        simulation (no curve and no noise) the law's crossing is only a lower bound on the stop
        and the budget is kept (the note says so).

    Returns: a new Plan (`Decisions.governor_threshold`, `Predictions.predicted_stop_step`,
    `predicted_end_step`, `predicted_end_loss`, one `governor: ...` note); the budget is
    unchanged (the ceiling the governor may not pass) unless `pick_budget` lowered it
    (`Decisions.max_steps`, `max_tokens`; `Predictions.total_tokens`, `device_hours` and
    `final_loss`, the curve's at the new budget, cooldown included).
    Raises:
        TrainplanError: both or neither given, a value or threshold not finite and > 0 (>= 0 for
            the threshold), an unknown law (see `plan_law`), or a curve of another model or
            vocabulary than the plan's.
    """
    if (value_device_hours_per_nat is None) == (threshold_nats_per_step is None):
        raise TrainplanError("give exactly one of value_device_hours_per_nat and "
                             "threshold_nats_per_step")
    d, p = plan.decisions, plan.predictions
    step_device_hours = p.step_time_s * d.devices / 3600.0
    if value_device_hours_per_nat is not None:
        thr = threshold_from_value(value_device_hours_per_nat, step_device_hours)
        how = (f"threshold {thr:.3g} nats/step = one step's {step_device_hours:.3g} device-hours / "
               f"{value_device_hours_per_nat:g} device-hours per nat")
    elif threshold_nats_per_step is not None:
        thr = float(threshold_nats_per_step)
        if not (math.isfinite(thr) and thr >= 0):
            raise TrainplanError(f"threshold_nats_per_step must be a finite number >= 0, got {thr!r}")
        how = f"threshold {thr:.3g} nats/step (given)"
    stop = final = loss = None  # the governor off: no prediction
    notes = [n for n in plan.notes if not n.startswith(GOVERNOR_NOTE)]
    if thr > 0:
        unique = max(1.0, float(plan.data_tokens) * float(d.data_fraction))
        # the law's fitted bits penalties when a law is at hand (a pilot curve needs none)
        fitted = law.bits if law is not None else (None if curve is not None else plan_law(plan, cache_dir).bits)
        offset = bits_loss_penalty(d.optimizer_bits, d.activation_bits, precision=d.precision,
                                   penalty=fitted)
        noise: float | None
        if curve is not None:
            curve = run_curve(plan, curve)
            noise = curve.sim_noise_nats if noise_nats is None else noise_nats
            what, gain = f"the pilots' held-out curve ({curve.source})", curve.cooldown_gain_nats
            ceiling = math.inf

            def loss_at(s: int) -> float:
                return float(curve.loss_with_early(s))
        else:
            law = law or plan_law(plan, cache_dir)
            noise, what, gain = noise_nats, f"the law's curve (law: {law.source})", 0.0
            ceiling = law.ceiling

            def loss_at(s: int) -> float:  # the law's shape (`learning_curve`'s `bounded`)
                return float(learning_curve([max(s, 1) * p.tokens_per_step], law=law, bounded=False,
                                            n_params=plan.law_n_params, unique_tokens=unique)[0])
        if noise is None:
            assert law is not None  # no noise only without a curve, where the law is set
            stop, final, loss = predict_stop_from_law(
                law, n_params=plan.law_n_params, tokens_per_step=p.tokens_per_step, threshold=thr,
                max_steps=d.max_steps, unique_tokens=unique, offset_nats=offset)
            rule = "where the law's mean drop per step crosses it"
        else:
            def simulate(max_steps: int):
                sim: dict[str, Any] = dict(threshold_nats_per_step=thr, max_steps=max_steps, eval_every=eval_every,
                           governor_settings=governor_settings, runs=runs)
                pairs = (simulated_decisions(plan, curve, noise_nats=noise, **sim) if curve is not None
                         else _simulated(plan, loss_at, noise, **sim))
                ends = sorted(e for _, e in pairs)
                return pairs[len(pairs) // 2][0], [s for s, _ in pairs], ends[len(ends) // 2]

            stop, sims, final = simulate(d.max_steps)
            if pick_budget and stop < d.max_steps:
                budget = picked_budget(sims, d.max_steps)
                if budget < d.max_steps:
                    how += (f"; budget {budget} steps of the {d.max_steps} allowed, picked from the "
                            f"curve ({1 + BUDGET_MARGIN:g} x the end of the {BUDGET_QUANTILE:.0%} "
                            "simulated stop)")
                    d, p = _with_budget(d, p, budget, min(loss_at(budget), ceiling) - gain + offset)
                    stop, sims, final = simulate(budget)
            if stop >= d.max_steps:
                final = d.max_steps
            at_once = final == stop < d.max_steps  # no cooldown: none of the pilots' cooldown gain
            loss = min(loss_at(final), ceiling) - (0.0 if at_once else gain) + offset
            rule = (f"the governor simulated over {what} with {noise:.3g} nats of evaluation "
                    f"noise ({len(sims)} runs: steps {sims[0]} to {sims[-1]})")
        if pick_budget and noise is None:
            how += "; budget kept (no curve to simulate the stop on: the law's crossing is a lower bound)"
        if stop >= d.max_steps:
            where = "the budget binds first"
        elif final > stop:
            where = f"predicted stop at step {stop} of {d.max_steps}, end of cooldown at {final}"
        else:
            where = (f"predicted stop at step {stop} of {d.max_steps}, at once (held-out loss no "
                     "longer falling: no cooldown)")
        notes.append(f"{GOVERNOR_NOTE}{how}; {where} ({rule})")
    else:
        notes.append(f"{GOVERNOR_NOTE}off")
    return dataclasses.replace(
        plan, decisions=dataclasses.replace(d, governor_threshold=thr),
        predictions=dataclasses.replace(p, predicted_stop_step=stop, predicted_end_step=final,
                                        predicted_end_loss=loss),
        notes=tuple(notes))


def run_curve(plan: Plan, curve: HeldoutCurve) -> HeldoutCurve:
    """The pilots' `curve` moved to `plan`'s tokens per step and unique tokens (`data_tokens x
    data_fraction`, at least 1): eq. (1) of `trainplan.costmodels.stopping.heldout_curve` for this run.

    Raises: TrainplanError for a curve of another model or vocabulary than the plan's (its
    constants and nats per token belong to both); a curve that records neither is taken as it
    is."""
    _check_curve_model(curve, plan)
    unique = max(1.0, float(plan.data_tokens) * float(plan.decisions.data_fraction))
    return curve.for_run(tokens_per_step=plan.predictions.tokens_per_step, unique_tokens=unique)


def simulated_decisions(plan: Plan, curve: HeldoutCurve, *, threshold_nats_per_step: float,
                        max_steps: int | None = None, noise_nats: float | None = None,
                        eval_every: int | None = None, governor_settings: dict | None = None,
                        runs: int = 16) -> list[tuple[int, int]]:
    """(decision, end) steps of the governor simulated `runs` times over the pilots' `curve`
    for `plan`, sorted (`trainplan.costmodels.stopping.simulation.simulated_stops`): the curve as the plan's
    run sees it (`run_curve`), its start as the pilots measured it (`loss_with_early`), with
    `noise_nats` of evaluation noise (default `sim_noise_nats`), `max_steps` (default the
    plan's), `eval_every` and `governor_settings` (`Governor` fields) as the live run's, the
    plan's warm-up. What `with_governor` predicts from, and `benchmarks/governor.py` reports.

    Raises: TrainplanError as `run_curve` and `simulated_stops`."""
    c = run_curve(plan, curve)
    return _simulated(plan, lambda s: float(c.loss_with_early(s)),
                      c.sim_noise_nats if noise_nats is None else noise_nats,
                      threshold_nats_per_step=threshold_nats_per_step, max_steps=max_steps,
                      eval_every=eval_every, governor_settings=governor_settings, runs=runs)


def _simulated(plan: Plan, loss_at, noise_nats: float, *, threshold_nats_per_step: float,
               max_steps: int | None, eval_every: int | None, governor_settings: dict | None,
               runs: int) -> list[tuple[int, int]]:
    return simulated_stops(loss_at, threshold_nats_per_step=threshold_nats_per_step,
                           max_steps=max_steps or plan.decisions.max_steps, noise_nats=noise_nats,
                           eval_every=eval_every, warmup_steps=plan.decisions.warmup_steps, runs=runs,
                           **(governor_settings or {}))


def _check_curve_model(curve: HeldoutCurve, plan: Plan) -> None:
    """Raise TrainplanError for a curve of another model or vocabulary than the plan's."""
    other_model = bool(curve.model) and curve.model != plan.model
    if other_model or (curve.vocab_size and curve.vocab_size != plan.vocab_size):
        recorded = " ".join(x for x in (curve.model, f"(vocabulary {curve.vocab_size})" if curve.vocab_size
                                         else "") if x)
        raise TrainplanError(
            f"the held-out curve was fitted on pilots of {recorded}; the plan is {plan.model} "
            f"(vocabulary {plan.vocab_size}): fit pilots of this model and vocabulary "
            "(benchmarks/governor.py shows how)")


def picked_budget(sims: list[int], max_steps: int) -> int:
    """The token budget `pick_budget` picks, in steps: min(max_steps, ceil((1 + BUDGET_MARGIN) x
    (q + cooldown_steps(q)))), q the BUDGET_QUANTILE decision of the sorted simulated decisions
    `sims` (max_steps when that one never stopped)."""
    q = sims[min(len(sims) - 1, int(BUDGET_QUANTILE * len(sims)))]
    if q >= max_steps:
        return max_steps
    return min(max_steps, math.ceil((1.0 + BUDGET_MARGIN) * (q + cooldown_steps(q))))


def _with_budget(d, p, steps: int, final_loss: float):
    """Decisions and predictions with the budget lowered to `steps` (device-hours scaled by the
    steps; anything else they hold, e.g. selection scoring, kept)."""
    per_step_dh = p.step_time_s * d.devices / 3600.0
    d2 = dataclasses.replace(d, max_steps=int(steps), max_tokens=int(steps) * p.tokens_per_step)
    p2 = dataclasses.replace(p, total_tokens=int(steps) * p.tokens_per_step, final_loss=float(final_loss),
                             device_hours=p.device_hours - per_step_dh * (d.max_steps - steps))
    return d2, p2


_CURVE_FILE = ("give a JSON file of HeldoutCurve.to_dict(), e.g. benchmarks/governor.py's "
               "governor_curve.json")


def read_heldout_curve(path) -> HeldoutCurve:
    """The pilot-calibrated held-out curve saved as JSON (`HeldoutCurve.to_dict`, e.g.
    `benchmarks/governor.py`'s `governor_curve.json`), for `trainplan solve --heldout-curve`.

    Raises:
        TrainplanError: the file cannot be read, is not JSON, or is not such a curve (the
            message names the path).
    """
    where = f"--heldout-curve {str(path)!r}"
    if not str(path):
        raise TrainplanError(f"--heldout-curve is empty; {_CURVE_FILE}")
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
        curve = HeldoutCurve.from_dict(raw)
    except OSError as e:
        raise TrainplanError(f"{where}: cannot read it: {e.strerror}; {_CURVE_FILE}") from None
    except TrainplanError as e:  # not the curve file's schema (HeldoutCurve.from_dict)
        raise TrainplanError(f"{where}: {e}; {_CURVE_FILE}") from None
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON
        raise TrainplanError(f"{where}: not a held-out curve: {str(e).splitlines()[0][:120]}; "
                             f"{_CURVE_FILE}") from None
    return curve


def governed_plan(plan: Plan, value_device_hours_per_nat: float | None,
                  curve: HeldoutCurve | None = None) -> Plan:
    """`with_governor(plan, value_device_hours_per_nat=...)`, or `plan` itself when the value is
    None (the CLI's `--loss-value-device-hours-per-nat`, not given: no governor). With a pilot
    `curve` (`--heldout-curve`) the stop is simulated over it and the budget picked from it
    (`pick_budget`).

    Raises: TrainplanError for a curve without a value (the curve only serves the governor)."""
    if value_device_hours_per_nat is None:
        if curve is not None:
            raise TrainplanError(CURVE_NEEDS_VALUE)
        return plan
    return with_governor(plan, value_device_hours_per_nat=value_device_hours_per_nat, curve=curve,
                         pick_budget=curve is not None)


__all__ = ["BUDGET_MARGIN", "BUDGET_QUANTILE", "governed_plan", "picked_budget", "plan_law",
           "read_heldout_curve", "run_curve", "simulated_decisions", "with_governor"]
