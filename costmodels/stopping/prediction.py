"""The compute governor's economics and the planner's predicted stop.

Pure (numpy only; the governor's rule is imported when a stop is simulated). The threshold
comes from a price (`threshold_from_value`); the predicted stop is either where a predicted
curve's drop per step crosses the threshold (`predict_stop_step` for a `CurveFit`,
`predict_stop_step_from_curve` for any curve, `predict_stop_from_law` for the planner's loss
law) or, better, where the governor's own rule decides when run over that curve with the
evaluation noise to expect (`simulated_stop_step`): the governor waits for an upper confidence
bound, so it decides later than the mean curve crosses.

Economics (`threshold_from_value`): one more step costs `cost_per_step` (device-seconds,
dollars, ...), one nat of loss is worth `value_per_nat` of the same unit; a step is worth taking
while (expected loss drop per step) x value_per_nat >= cost_per_step, i.e. while the drop per
step is at least threshold = cost_per_step / value_per_nat nats per step. Loss is in nats per
token of the run's tokenizer, so a threshold does not transfer across tokenizers.

Steps are *steps done* (1 after the first optimizer step), as in `costmodels.stopping.rule`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import numpy as np

from trainplan_errors import TrainplanError


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


def predict_stop_step(fit, threshold: float, cost_per_step: float = 1.0, *,
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


def cooldown_steps(steps: int, fraction: float = 0.2) -> int:
    """Cooldown length after a stop decided with `steps` done: c such that c is `fraction` of
    the final run (warmup-stable-decay, Hu et al. 2024: the last 20%), c = ceil(f / (1 - f) x
    steps), 25% of `steps` for f = 0.2; at least 1 when f > 0, 0 when f = 0.

    Raises: TrainplanError unless 0 <= fraction < 1 and steps >= 0."""
    if not 0.0 <= fraction < 1.0:
        raise TrainplanError(f"cooldown fraction must be in [0, 1), got {fraction!r}")
    if not steps >= 0:
        raise TrainplanError(f"steps must be >= 0, got {steps!r}")
    return 0 if fraction == 0 else max(1, math.ceil(fraction / (1.0 - fraction) * steps - 1e-9))


def governed_stop_step(stop_step: int, max_steps: int, fraction: float = 0.2) -> int:
    """The governor's rule applied to a predicted crossing: a stop whose cooldown would reach
    the budget saves nothing and is not taken, so the predicted stop is `max_steps` when
    stop_step + cooldown_steps(stop_step) >= max_steps, else `stop_step`."""
    return max_steps if stop_step + cooldown_steps(stop_step, fraction) >= max_steps else int(stop_step)


def predict_stop_from_law(law, *, n_params: float, tokens_per_step: float, threshold: float,
                          max_steps: int, unique_tokens: float | None = None,
                          cost_per_step: float = 1.0, horizon_steps: int = 1, start: int = 1,
                          offset_nats: float = 0.0,
                          cooldown_fraction: float = 0.2) -> tuple[int, int, float]:
    """The planner's predicted stop: where the drop per step of its loss law along the run,

        L(s) = law at (s x tokens_per_step tokens seen, `unique_tokens` unique)    (eq. 2 of
        Hoffmann et al. 2022 with Muennighoff et al. 2023's effective data; `learning_curve`),

    falls below `threshold` (per unit `cost_per_step`; `predict_stop_step_from_curve`), with the
    governor's rule that a stop whose cooldown reaches the budget is not taken
    (`governed_stop_step`). Repeated data makes the drop per step fall off exponentially after
    the first epoch (the effective tokens' growth decays as exp(-repeats / R_D*)): the law
    predicts the stop of a data-constrained run from the unique tokens alone.

    `law`: a `costmodels.loss.law.LossLaw`; `offset_nats` is added to the loss (e.g. the optimizer
    bits penalty): it moves the curve, not its slope.

    Returns: (predicted stop step = the step the governor decides at, in steps done; the
    step the run ends, its cooldown included: stop + `cooldown_steps(stop)`, `max_steps` when
    the budget binds; the law's loss there + offset_nats: the governed run's final loss, the
    law being a curve of end-of-run losses, cooldown included).
    Raises: TrainplanError on bad counts, a negative threshold or a non-positive cost.
    """
    from costmodels.loss.law import learning_curve

    if not (math.isfinite(tokens_per_step) and tokens_per_step > 0):
        raise TrainplanError(f"tokens_per_step must be > 0, got {tokens_per_step!r}")

    def loss_at(s: int) -> float:
        return float(learning_curve([max(s, 1) * tokens_per_step], law=law, n_params=n_params,
                                    unique_tokens=unique_tokens)[0])

    crossing = predict_stop_step_from_curve(loss_at, threshold, max_steps, cost_per_step=cost_per_step,
                                            horizon_steps=horizon_steps, start=start)
    stop = governed_stop_step(crossing, max_steps, cooldown_fraction)
    final = max_steps if stop >= max_steps else stop + cooldown_steps(stop, cooldown_fraction)
    return stop, final, loss_at(final) + offset_nats


def simulated_stop_step(loss_at: Callable[[int], float], **kw) -> tuple[int, list[int]]:
    """`simulated_stops`' decisions: (the median decision, upper median for an even count; all
    decisions, sorted), in steps done. Same arguments and errors as `simulated_stops`."""
    decisions = sorted(d for d, _ in simulated_stops(loss_at, **kw))
    return int(decisions[len(decisions) // 2]), decisions


def simulated_stops(loss_at: Callable[[int], float], *, threshold_nats_per_step: float,
                    max_steps: int, noise_nats: float, eval_every: int | None = None,
                    warmup_steps: int = 0, runs: int = 16, seed: int = 0,
                    **settings) -> list[tuple[int, int]]:
    """Where the governor is expected to decide to stop a run whose held-out loss follows
    `loss_at(steps done)` (nats/token), measured every `eval_every` steps (default
    `costmodels.stopping.rule.default_eval_every`) with independent Gaussian noise of `noise_nats`:
    the median decision of `costmodels.stopping.rule.Governor.replay` over `runs` simulated
    evaluation series (one when the noise is 0). Independent noise understates how far one
    real run's decision scatters: a real held-out curve also wanders over several evaluations
    (`benchmarks/governor.py`: the quartiles were 210-210 where the run decided at 180).

    Why not the curve's own crossing (`predict_stop_step_from_curve`): the
    governor waits for the *upper* confidence bound of its fit's gain (and of the trend's) to
    fall below the threshold, so it decides later than the mean curve crosses, by an amount set
    by the evaluation noise, the evaluation period and the curve's shape. Simulating the rule
    on the predicted curve predicts that lag; the spread of the decisions says how much one
    run's decision scatters. A simulated run that never stops on marginal gain counts as
    `max_steps` (the budget binds). `settings`: other `Governor` fields (refit_every, ...).

    Returns: one (decision, end) per simulated run, in steps done, sorted: the end is the
    decision plus its cooldown, the decision itself when the governor ended the run at once
    (held-out loss no longer falling, `Governor.skip_cooldown_when_rising`), `max_steps` when
    the budget binds. `simulated_stop_step` gives the median decision.
    Raises: TrainplanError on a negative noise, fewer than 1 run or bad Governor settings.
    """
    from costmodels.stopping.rule import Governor, default_eval_every

    if not (math.isfinite(noise_nats) and noise_nats >= 0):
        raise TrainplanError(f"noise_nats must be a finite number >= 0, got {noise_nats!r}")
    if not isinstance(runs, int) or runs < 1:
        raise TrainplanError(f"runs must be a whole number >= 1, got {runs!r}")
    every = eval_every or default_eval_every(max_steps)
    steps = np.arange(every, max_steps + 1, every)
    curve = np.array([float(loss_at(int(s))) for s in steps])
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(runs if noise_nats > 0 else 1):
        y = curve + rng.normal(0.0, noise_nats, steps.size) if noise_nats > 0 else curve
        gov = Governor(threshold_nats_per_step=threshold_nats_per_step, max_steps=max_steps,
                       warmup_steps=warmup_steps, **settings)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            dec = gov.replay(heldout_loss=list(zip(steps.tolist(), y.tolist(), strict=False)))
        if dec.reason == "marginal_gain":
            out.append((int(dec.decided_at), int(dec.final_step)))
        else:
            out.append((max_steps, max_steps))
    return sorted(out)


__all__ = ["cooldown_steps", "governed_stop_step", "predict_stop_from_law", "predict_stop_step",
           "predict_stop_step_from_curve", "simulated_stop_step", "simulated_stops", "threshold_from_value"]
