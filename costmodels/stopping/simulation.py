"""Where the governor is expected to stop a run whose held-out loss follows a predicted curve:
its own rule (`trainplan.costmodels.stopping.rule.Governor`) replayed over simulated noisy evaluations.

Pure (numpy). The curve's own crossing (`trainplan.costmodels.stopping.prediction`) is where the *mean*
drop per step falls below the threshold; the governor waits for the *upper* confidence bound,
so it decides later, by an amount set by the evaluation noise, the evaluation period and the
curve's shape. The planner (`trainplan.planner.governor`) predicts its stop with `simulated_stops` over
the held-out curve calibrated on pilot runs (`trainplan.costmodels.stopping.heldout_curve`).

Steps are *steps done* (1 after the first optimizer step), as in `trainplan.costmodels.stopping.rule`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from trainplan.costmodels.stopping.rule import Governor
from trainplan.costmodels.stopping.schedule import default_eval_every
from trainplan.errors import TrainplanError


def simulated_stop_step(loss_at: Callable[[int], float], **kw: Any) -> tuple[int, list[int]]:
    """`simulated_stops`' decisions: (the median decision, upper median for an even count; all
    decisions, sorted), in steps done. Same arguments and errors as `simulated_stops`."""
    decisions = sorted(d for d, _ in simulated_stops(loss_at, **kw))
    return int(decisions[len(decisions) // 2]), decisions


def simulated_stops(loss_at: Callable[[int], float], *, threshold_nats_per_step: float,
                    max_steps: int, noise_nats: float, eval_every: int | None = None,
                    warmup_steps: int = 0, runs: int = 16, seed: int = 0,
                    **settings: Any) -> list[tuple[int, int]]:
    """Where the governor is expected to decide to stop a run whose held-out loss follows
    `loss_at(steps done)` (nats/token), measured every `eval_every` steps (default
    `trainplan.costmodels.stopping.schedule.default_eval_every`) with independent Gaussian noise of
    `noise_nats`: the median decision of `trainplan.costmodels.stopping.rule.Governor.replay` over `runs`
    simulated evaluation series (one when the noise is 0). Independent noise understates how
    far one real run's decision scatters: a real held-out curve also wanders over several
    evaluations (`benchmarks/governor.py`: the quartiles were 210-210 where the run decided at
    180).

    Why not the curve's own crossing (`trainplan.costmodels.stopping.prediction.predict_stop_step_from_curve`):
    the governor waits for the *upper* confidence bound of its fit's gain (and of the trend's) to
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
            # a stop decision always carries its step and the run's end (`Decision`)
            assert dec.decided_at is not None and dec.final_step is not None
            out.append((int(dec.decided_at), int(dec.final_step)))
        else:
            out.append((max_steps, max_steps))
    return sorted(out)
