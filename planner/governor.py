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
- predicted stop step: where the drop per step of the plan's loss law along the run (the law the
  planner used: the local law fitted by `trainplan calibrate` on the cpu profile, else the
  published one; data-constrained through Muennighoff et al. 2023's effective tokens over the
  plan's unique tokens, data_tokens x data_fraction) falls below the threshold, with the
  governor's rule that a stop whose cooldown reaches the budget is not taken
  (`costmodels.governor.predict_stop_from_law`). Given the evaluation noise to expect, the
  governor's own rule is simulated over that curve instead (`costmodels.stopping.
  simulated_stop_step`): it decides on an upper confidence bound, later than the crossing.

`with_governor` returns the plan with both written in (`Decisions.governor_threshold`,
`Predictions.predicted_stop_step`, `predicted_end_step`, `predicted_end_loss`) and a note
saying how.
"""

from __future__ import annotations

import dataclasses
import math

from costmodels.governor import cooldown_steps, predict_stop_from_law, threshold_from_value
from costmodels.loss import LossLaw, bits_loss_penalty, learning_curve
from costmodels.stopping import simulated_stop_step
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
                  noise_nats: float | None = None, eval_every: int | None = None,
                  governor_settings: dict | None = None, cache_dir=None) -> Plan:
    """`plan` with the compute governor on: its threshold and predicted stop written in.

    Give exactly one of
        value_device_hours_per_nat: device-hours one nat of held-out loss is worth; the
            threshold is then the plan's predicted cost of one step (device-hours) over it;
        threshold_nats_per_step: the threshold itself (0: the governor off, no prediction).
    law: the loss law to predict the curve with (default: the plan's, `plan_law`).
    noise_nats: the held-out evaluation noise expected (nats, e.g. measured on pilot runs).
        Given, the predicted stop is the governor's own rule simulated over the law's curve
        with that noise, evaluated every `eval_every` steps (default: a governed run's,
        max_steps // 50), with `governor_settings` (`Governor` fields)
        (`costmodels.stopping.simulated_stop_step`): it waits for an upper confidence bound, so
        it stops later than the curve's crossing. None: the crossing of the law's mean curve
        (`costmodels.governor.predict_stop_from_law`), a lower bound on the governor's stop.

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
        law = law or plan_law(plan, cache_dir)
        unique = max(1.0, float(plan.data_tokens) * float(d.data_fraction))
        offset = bits_loss_penalty(d.optimizer_bits)
        stop, final, loss = predict_stop_from_law(
            law, n_params=plan.model_n_params, tokens_per_step=p.tokens_per_step, threshold=thr,
            max_steps=d.max_steps, unique_tokens=unique, offset_nats=offset)
        rule = "the law's curve crosses it"
        if noise_nats is not None:
            def loss_at(s: int) -> float:
                return float(learning_curve([max(s, 1) * p.tokens_per_step], law=law,
                                            n_params=plan.model_n_params, unique_tokens=unique)[0])

            stop, runs = simulated_stop_step(loss_at, threshold_nats_per_step=thr,
                                             max_steps=d.max_steps, noise_nats=noise_nats,
                                             eval_every=eval_every, warmup_steps=d.warmup_steps,
                                             **(governor_settings or {}))
            final = d.max_steps if stop >= d.max_steps else stop + cooldown_steps(stop)
            loss = loss_at(final) + offset
            rule = (f"the governor simulated over the law's curve with {noise_nats:.3g} nats of "
                    f"evaluation noise ({len(runs)} runs: steps {runs[0]} to {runs[-1]})")
        where = ("the budget binds first" if stop >= d.max_steps else
                 f"predicted stop at step {stop} of {d.max_steps} ({rule}), end of cooldown at {final}")
        notes.append(f"{GOVERNOR_NOTE}{how}; {where} (law: {law.source})")
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
