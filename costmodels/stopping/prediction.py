"""The compute governor's economics and the stop a predicted curve implies.

Pure (no torch). The threshold comes from a price (`threshold_from_value`); the predicted
stop is where a predicted curve's drop per step crosses the threshold (`predict_stop_step` for
a `trainplan.costmodels.stopping.curve.CurveFit`, `predict_stop_step_from_curve` for any curve,
`predict_stop_from_law` for the planner's loss law). The governor waits for an upper
confidence bound, so it decides later than the mean curve crosses: where its own rule decides
over a predicted curve with the evaluation noise to expect is
`trainplan.costmodels.stopping.simulation.simulated_stop_step`, which builds on the rule
(`trainplan.costmodels.stopping.rule`) that builds on this module.

Economics (`threshold_from_value`): one more step costs `cost_per_step` (device-seconds,
dollars, ...), one nat of loss is worth `value_per_nat` of the same unit; a step is worth taking
while (expected loss drop per step) x value_per_nat >= cost_per_step, i.e. while the drop per
step is at least threshold = cost_per_step / value_per_nat nats per step. Loss is in nats per
token of the run's tokenizer, so a threshold does not transfer across tokenizers.

Steps are *steps done* (1 after the first optimizer step), as in `trainplan.costmodels.stopping.rule`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from trainplan.costmodels.loss.law import LossLaw, learning_curve
from trainplan.costmodels.stopping.curve import CurveFit
from trainplan.costmodels.stopping.schedule import COOLDOWN_FRACTION, cooldown_steps, governed_stop_step
from trainplan.errors import TrainplanError


def threshold_from_value(value_per_nat: float, cost_per_step: float) -> float:
    """The governor's stopping threshold, nats per step: cost_per_step / value_per_nat.

    A step is worth taking while (expected loss drop per step, nats) x (value of one nat) >=
    (cost of one step), both sides in the same unit (device-seconds, dollars, joules). E.g. a
    step costs 2 device-s and a nat of held-out loss is worth 10,000 device-s: stop once the
    loss drops by less than 2e-4 nats per step.

    Raises: TrainplanError unless both are finite and > 0.
    """
    for name, v in (("value_per_nat", value_per_nat), ("cost_per_step", cost_per_step)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise TrainplanError(f"{name} must be a finite number > 0, got {v!r}")
    return float(cost_per_step) / float(value_per_nat)


def _first_below(gain_per_step: Callable[[float], float], threshold: float, start: int,
                 max_steps: int) -> int:
    """Smallest integer step in [start, max_steps] with gain_per_step(step) < threshold, for a
    non-increasing gain_per_step (bisection); max_steps when there is none."""
    if gain_per_step(start) < threshold:
        return start
    if gain_per_step(max_steps) >= threshold:
        return max_steps
    lo, hi = start, max_steps  # gain(lo) >= thr > gain(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if gain_per_step(mid) < threshold:
            hi = mid
        else:
            lo = mid
    return hi


def _check_threshold(threshold: float, cost_per_step: float, max_steps: int, horizon_steps: int):
    if not (math.isfinite(threshold) and threshold >= 0):
        raise TrainplanError(f"threshold must be a finite number >= 0, got {threshold!r}")
    if not (math.isfinite(cost_per_step) and cost_per_step > 0):
        raise TrainplanError(f"cost_per_step must be a finite number > 0, got {cost_per_step!r}")
    if not isinstance(max_steps, int) or max_steps < 1:
        raise TrainplanError(f"max_steps must be a whole number >= 1, got {max_steps!r}")
    if not isinstance(horizon_steps, int) or horizon_steps < 1:
        raise TrainplanError(f"horizon_steps must be a whole number >= 1, got {horizon_steps!r}")


def predict_stop_step(fit: CurveFit, threshold: float, cost_per_step: float = 1.0, *,
                      max_steps: int = 10**9, horizon_steps: int = 1, start: int = 0) -> int:
    """First step t >= start at which the fitted curve's gain per unit cost,
    (L(t) - L(t + h)) / h / cost_per_step, falls below `threshold`; `max_steps` if it never
    does before. With the default cost_per_step = 1 the threshold is in nats per step (the
    `Governor`'s unit). Uses the mean curve: the governor, which waits for the *upper* bound,
    stops a little later, by an amount that shrinks as the fit tightens.

    For eq. (1) with h -> 0 this is t = (alpha * A / (threshold * cost))^(1 / (1 + alpha)) - t0.

    Raises: TrainplanError on a negative threshold, a non-positive cost or bad step counts.
    """
    _check_threshold(threshold, cost_per_step, max_steps, horizon_steps)
    h = float(horizon_steps)
    return _first_below(lambda s: float(fit.gain(s, h)) / h / cost_per_step, threshold,
                        int(start), max_steps)


def predict_stop_step_from_curve(loss_at: Callable[[int], float], threshold: float,
                                 max_steps: int, *, cost_per_step: float = 1.0,
                                 horizon_steps: int = 1, start: int = 1) -> int:
    """The same rule over any predicted curve, e.g. the planner's loss law along the run:

        tps = plan.predictions.tokens_per_step
        loss_at = lambda s: float(learning_curve([max(s, 1) * tps], law=law, n_params=n)[0])
        predict_stop_step_from_curve(loss_at, threshold, plan.decisions.max_steps)

    `loss_at(step)` (nats/token) must be non-increasing with a non-increasing drop per step (a
    convex curve, as every power law plus floor is) for steps >= `start` (default 1: a law in
    tokens has no value at step 0): the first crossing is found by bisection.

    Returns: the first step in [start, max_steps] with a drop per unit cost below `threshold`,
    or max_steps (the budget binds first).
    Raises: TrainplanError on a negative threshold, a non-positive cost or bad step counts.
    """
    _check_threshold(threshold, cost_per_step, max_steps, horizon_steps)
    h = int(horizon_steps)
    return _first_below(lambda s: (float(loss_at(int(s))) - float(loss_at(int(s) + h))) / h / cost_per_step,
                        threshold, int(start), max_steps)


def predict_stop_from_law(law: LossLaw, *, n_params: float, tokens_per_step: float, threshold: float,
                          max_steps: int, unique_tokens: float | None = None,
                          cost_per_step: float = 1.0, horizon_steps: int = 1, start: int = 1,
                          offset_nats: float = 0.0,
                          cooldown_fraction: float = COOLDOWN_FRACTION) -> tuple[int, int, float]:
    """The planner's predicted stop: where the drop per step of its loss law along the run,

        L(s) = law at (s x tokens_per_step tokens seen, `unique_tokens` unique)    (eq. 2 of
        Hoffmann et al. 2022 with Muennighoff et al. 2023's effective data; `learning_curve`),

    falls below `threshold` (per unit `cost_per_step`; `predict_stop_step_from_curve`), with the
    governor's rule that a stop whose cooldown reaches the budget is not taken
    (`trainplan.costmodels.stopping.schedule.governed_stop_step`). Repeated data makes the drop per step
    fall off exponentially after the first epoch (the effective tokens' growth decays as
    exp(-repeats / R_D*)): the law predicts the stop of a data-constrained run from the unique
    tokens alone.

    `law`: a `trainplan.costmodels.loss.law.LossLaw`; `offset_nats` is added to the loss (e.g. the optimizer
    bits penalty): it moves the curve, not its slope.

    Returns: (predicted stop step = the step the governor decides at, in steps done; the
    step the run ends, its cooldown included: stop + `cooldown_steps(stop)`
    (`trainplan.costmodels.stopping.schedule`), `max_steps` when the budget binds; the law's loss there +
    offset_nats: the governed run's final loss, the law being a curve of end-of-run losses,
    cooldown included).
    Raises: TrainplanError on bad counts, a negative threshold or a non-positive cost.
    """
    if not (math.isfinite(tokens_per_step) and tokens_per_step > 0):
        raise TrainplanError(f"tokens_per_step must be > 0, got {tokens_per_step!r}")

    def loss_at(s: int) -> float:  # the law's shape: unbounded (a curve clipped at ln V is flat)
        return float(learning_curve([max(s, 1) * tokens_per_step], law=law, n_params=n_params,
                                    unique_tokens=unique_tokens, bounded=False)[0])

    crossing = predict_stop_step_from_curve(loss_at, threshold, max_steps, cost_per_step=cost_per_step,
                                            horizon_steps=horizon_steps, start=start)
    stop = governed_stop_step(crossing, max_steps, cooldown_fraction)
    final = max_steps if stop >= max_steps else stop + cooldown_steps(stop, cooldown_fraction)
    return stop, final, min(loss_at(final), law.ceiling) + offset_nats
