"""A governed run's schedule around the stopping rule: the cooldown after a stop and how often
the held-out loss is evaluated.

Pure Python. After a stop on marginal gain (`trainplan.costmodels.stopping.rule.Governor`) the
run cools down, warmup-stable-decay as in Hu et al. 2024 (MiniCPM): the
learning rate decays linearly to `LR_FLOOR` of the stable rate over the last
`COOLDOWN_FRACTION` of the final run (`cooldown_steps`, `lr_multiplier`), the same shape as
`trainplan.executor.apply.applied.lr_at`'s planned decay; a stop whose cooldown would reach the budget is not
taken (`governed_stop_step`). A governed run evaluates the held-out loss `GOVERNED_EVALS` times
(`default_eval_every`) so that the curve fit has points early.

Steps are *steps done* (1 after the first optimizer step), as in `trainplan.costmodels.stopping.rule`.
"""

from __future__ import annotations

import math

from trainplan.errors import TrainplanError

#: Share of the final run spent in the cooldown, as `trainplan.executor.apply.applied.lr_at` (last 20% of steps;
#: Hu et al. 2024, MiniCPM, warmup-stable-decay).
COOLDOWN_FRACTION = 0.2
#: The cooldown ends at this fraction of the stable learning rate, as `lr_at`.
LR_FLOOR = 0.05


def cooldown_steps(steps: int, fraction: float = COOLDOWN_FRACTION) -> int:
    """Cooldown length after a stop decided with `steps` done: c such that c is `fraction` of
    the final run (warmup-stable-decay, Hu et al. 2024: the last 20%), c = ceil(f / (1 - f) x
    steps), 25% of `steps` for f = 0.2; at least 1 when f > 0, 0 when f = 0.

    Raises: TrainplanError unless 0 <= fraction < 1 and steps >= 0."""
    if not 0.0 <= fraction < 1.0:
        raise TrainplanError(f"cooldown fraction must be in [0, 1), got {fraction!r}")
    if not steps >= 0:
        raise TrainplanError(f"steps must be >= 0, got {steps!r}")
    return 0 if fraction == 0 else max(1, math.ceil(fraction / (1.0 - fraction) * steps - 1e-9))


def governed_stop_step(stop_step: int, max_steps: int, fraction: float = COOLDOWN_FRACTION) -> int:
    """The governor's rule applied to a predicted crossing: a stop whose cooldown would reach
    the budget saves nothing and is not taken, so the predicted stop is `max_steps` when
    stop_step + cooldown_steps(stop_step) >= max_steps, else `stop_step`."""
    return max_steps if stop_step + cooldown_steps(stop_step, fraction) >= max_steps else int(stop_step)


def lr_multiplier(step: int, state: dict) -> float:
    """Learning-rate multiplier for the 0-based step index `step` under a governor cooldown
    `state` ({"cooldown_start": s, "final_step": n}, see `Governor.state`): 1 before s, then
    max(LR_FLOOR, (n - step) / (n - s)): the same linear decay `lr_at` applies over the last
    20% of a planned run, started by the stop decision instead of the plan."""
    s, n = state.get("cooldown_start"), state.get("final_step")
    if s is None or n is None or step < s:
        return 1.0
    return max(LR_FLOOR, (n - step) / max(n - s, 1))


#: Held-out evaluations a governed run makes by default: every max_steps // GOVERNED_EVALS
#: steps (an ungoverned run makes 10), so that the fit has `min_points` evaluations early on.
GOVERNED_EVALS = 50


def default_eval_every(max_steps: int) -> int:
    """A governed run's default held-out evaluation period: max_steps // GOVERNED_EVALS, >= 1."""
    return max(1, int(max_steps) // GOVERNED_EVALS)
