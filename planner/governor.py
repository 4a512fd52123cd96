"""The planner's side of the compute governor: the stopping threshold and the predicted stop.

A plan's budget (`Decisions.max_steps`) is the most the run may spend; the governor
(`executor.governor`) ends it earlier when its next steps are no longer worth their cost. The
planner fixes the governor's threshold from economics and predicts where it will stop:

- threshold (nats/token per step) = cost of one step / value of one nat of held-out loss.
  The cost of a step is the plan's own prediction, `step_time_s x devices / 3600`
  device-hours; the value of a nat is the user's (`--loss-value-device-hours-per-nat` on
  `trainplan solve` and `demo`): how many device-hours one nat less held-out loss is worth.
  A step is worth taking while it lowers the loss by at least the threshold
  (`costmodels.governor.threshold_from_value`).
- predicted stop step: the step at which the governor's own rule (`costmodels.stopping.
  Governor`: the same refit cadence, fit window, confidence bound, trend check and cooldown
  rule), run over a predicted held-out curve evaluated as the run will be (every `eval_every`
  steps, with the pilots' evaluation noise), decides to stop: the median over simulated
  evaluation series (`costmodels.stop_prediction.simulated_stop_step`). The curve is, best, the
  one calibrated on pilot runs (`curve=`, `costmodels.heldout_curve`: a fresh-data law plus a
  penalty for repeated data, which can rise, as an overfitting run's held-out loss does);
  without one, the plan's loss law along the run (the local law of `trainplan calibrate` on the
  cpu profile, else the published one, data-constrained through Muennighoff et al. 2023's
  effective tokens), which only flattens and so misplaces a stop that overfitting sets; and
  without an evaluation noise either, where the law's mean drop per step crosses the threshold
  (`costmodels.stop_prediction.predict_stop_from_law`), a lower bound on the governor's stop.

`with_governor` returns the plan with both written in (`Decisions.governor_threshold`,
`Predictions.predicted_stop_step`, `predicted_end_step`, `predicted_end_loss`) and a note
saying how.
"""

from __future__ import annotations

import dataclasses
import math

from costmodels.heldout_curve import HeldoutCurve
from costmodels.bits import bits_loss_penalty
from costmodels.loss import LossLaw, learning_curve
from costmodels.stop_prediction import (cooldown_steps, predict_stop_from_law, simulated_stop_step,
                                        threshold_from_value)
from hardware_profiles.errors import TrainplanError
from planner.plan import Plan

LAW_NOTE = "loss law: "
"""How `planner.api` names the plan's loss law in `Plan.notes`."""
GOVERNOR_NOTE = "governor: "


def plan_law(plan: Plan, cache_dir=None) -> LossLaw:
    """The loss law the planner used for `plan`, from the source its notes name: the local law
    of (model, vocabulary) when its source matches (cpu plans), else the published law of that
    source.

    Raises:
        TrainplanError: the plan names a law that is neither (a law passed to `solve` by the
            caller): pass it to `with_governor(law=...)`.
    """
    source = next((n[len(LAW_NOTE):] for n in plan.notes if n.startswith(LAW_NOTE)), None)
    candidates = [LossLaw.besiroglu2024(), LossLaw.hoffmann2022()]
    try:
        from costmodels.loss_cache import load_local_law

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
                  runs: int = 16, cache_dir=None) -> Plan:
    """`plan` with the compute governor on: its threshold and predicted stop written in.

    Give exactly one of
        value_device_hours_per_nat: device-hours one nat of held-out loss is worth; the
            threshold is then the plan's predicted cost of one step (device-hours) over it;
        threshold_nats_per_step: the threshold itself (0: the governor off, no prediction).
    curve: the held-out curve calibrated on pilot runs (`costmodels.heldout_curve.
        fit_heldout_curve`); it is moved to the plan's tokens per step and unique tokens
        (`HeldoutCurve.for_run`) and the governor simulated over it with `noise_nats` (default:
        the pilots' `curve.noise_nats`). The predicted end loss is the curve at the end step
        less the pilots' cooldown gain.
    law: without a curve, the loss law to predict the curve with (default: the plan's,
        `plan_law`).
    noise_nats: the held-out evaluation noise expected (nats). With a curve or a noise, the
        predicted stop is the governor's own rule simulated over the curve (`runs` series of
        evaluations every `eval_every` steps, default: a governed run's, max_steps // 50, with
        `governor_settings`, `Governor` fields; `costmodels.stop_prediction.
        simulated_stop_step`): it waits for an upper confidence bound, so it stops later than
        the curve's crossing. Neither: the crossing of the law's mean curve
        (`costmodels.stop_prediction.predict_stop_from_law`), a lower bound on the stop.

    Returns: a new Plan (`Decisions.governor_threshold`, `Predictions.predicted_stop_step`,
    `predicted_end_step`, `predicted_end_loss`, one `governor: ...` note); the budget is
    unchanged: it stays the ceiling the governor may not pass.
    Raises:
        TrainplanError: both or neither given, a value or threshold not finite and > 0 (>= 0 for
            the threshold), or an unknown law (see `plan_law`).
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
    else:
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
        if curve is not None:
            curve = curve.for_run(tokens_per_step=p.tokens_per_step, unique_tokens=unique)
            noise = curve.noise_nats if noise_nats is None else noise_nats
            what, gain = f"the pilots' held-out curve ({curve.source})", curve.cooldown_gain_nats

            def loss_at(s: int) -> float:
                return float(curve.loss_at(s))
        else:
            law = law or plan_law(plan, cache_dir)
            noise, what, gain = noise_nats, f"the law's curve (law: {law.source})", 0.0

            def loss_at(s: int) -> float:
                return float(learning_curve([max(s, 1) * p.tokens_per_step], law=law,
                                            n_params=plan.model_n_params, unique_tokens=unique)[0])
        if noise is None:
            stop, final, loss = predict_stop_from_law(
                law, n_params=plan.model_n_params, tokens_per_step=p.tokens_per_step, threshold=thr,
                max_steps=d.max_steps, unique_tokens=unique, offset_nats=offset)
            rule = "where the law's mean drop per step crosses it"
        else:
            stop, sims = simulated_stop_step(loss_at, threshold_nats_per_step=thr,
                                             max_steps=d.max_steps, noise_nats=noise,
                                             eval_every=eval_every, warmup_steps=d.warmup_steps,
                                             runs=runs, **(governor_settings or {}))
            final = d.max_steps if stop >= d.max_steps else stop + cooldown_steps(stop)
            loss = loss_at(final) - gain + offset
            rule = (f"the governor simulated over {what} with {noise:.3g} nats of evaluation "
                    f"noise ({len(sims)} runs: steps {sims[0]} to {sims[-1]})")
        where = ("the budget binds first" if stop >= d.max_steps else
                 f"predicted stop at step {stop} of {d.max_steps}, end of cooldown at {final}")
        notes.append(f"{GOVERNOR_NOTE}{how}; {where} ({rule})")
    else:
        notes.append(f"{GOVERNOR_NOTE}off")
    return dataclasses.replace(
        plan, decisions=dataclasses.replace(d, governor_threshold=thr),
        predictions=dataclasses.replace(p, predicted_stop_step=stop, predicted_end_step=final,
                                        predicted_end_loss=loss),
        notes=tuple(notes))


def governed_plan(plan: Plan, value_device_hours_per_nat: float | None) -> Plan:
    """`with_governor(plan, value_device_hours_per_nat=...)`, or `plan` itself when the value is
    None (the CLI's `--loss-value-device-hours-per-nat`, not given: no governor)."""
    if value_device_hours_per_nat is None:
        return plan
    return with_governor(plan, value_device_hours_per_nat=value_device_hours_per_nat)


__all__ = ["governed_plan", "plan_law", "with_governor"]
