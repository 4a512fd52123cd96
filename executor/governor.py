"""The compute governor inside a training run: stop it when its next steps are no longer
worth their cost.

The stopping rule (`Governor`, `Decision`, reasons `nan`, `diverged`, `marginal_gain`, `budget`)
is pure and lives in `trainplan.costmodels.stopping.rule`; this module runs it in the loop (`GovernedLoop`,
what `trainplan.executor.train.run` calls) and draws it (`curve_frame`, `plot_governor`).

Steps are counted as *steps done* (the record's `rec.steps`, 1 after the first optimizer step),
the same axis as `RunRecord.heldout_loss`. In a loop over 0-based step indices, which is what
`GovernedLoop` does for `trainplan.executor.train.run`:

    gov = Governor.for_plan(plan)                       # or Governor(threshold_nats_per_step=...)
    for step in range(start, d.max_steps):
        lr = lr_at(step, plan) * gov.lr_multiplier(step)     # 0-based index of the step to run
        ...train one step -> loss...; rec.steps = step + 1
        gov.observe_train(rec.steps, loss)
        if rec.steps % eval_every == 0 or rec.steps == gov.final_step:   # the loss at the stop
            gov.observe_heldout(rec.steps, heldout)
        decision = gov.decide(rec.steps)
        if decision.end_now:
            stop["reason"] = decision.reason; break

The cooldown is the stop decision's: `lr_multiplier` decays the planned rate linearly to 5% from
the decision to `gov.final_step` (warmup-stable-decay with the decay triggered by the stop).
The fit needs `min_points` evaluations at steps >= `fit_from` x (steps done): evaluate every
max_steps // 50 steps or more often (`run`'s default of max_steps // 10 leaves too few; a
governed `run` defaults to max_steps // GOVERNED_EVALS). Under data or sequence parallelism
every rank feeds the governor the mean of the ranks' losses, so all decide alike. On resume,
`gov.replay(rec.train_loss, rec.heldout_loss)` rebuilds the state, cooldown included.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from trainplan.costmodels.stopping.heldout_curve import PilotCurve
from trainplan.costmodels.stopping.rule import Decision, Governor
from trainplan.costmodels.stopping.schedule import default_eval_every
from trainplan.executor.measure import gather_floats

NOTE = "governor: "
"""The prefix with which the record's notes and `governor.json` name the governor's decisions."""


class GovernedLoop:
    """The governor inside `trainplan.executor.train.run`'s loop, as the module docstring's loop shows
    (`for_run` builds it; `lr`, `eval_due` and `after_step` are the loop's three calls).

    Off (`for_run` without a governor and a plan threshold of 0) it is inert: `lr` is 1.0,
    `eval_due` False, `after_step` "" and `end` the budget, so the loop runs as without it.
    Under data or sequence parallelism every rank feeds it the mean of the ranks' losses
    (one collective per step), so that all ranks decide alike and cool down alike."""

    def __init__(self, gov: Governor | None, *, out=None, rank: int = 0, world: int = 1,
                 predicted_stop_step: int | None = None):
        self.gov, self.out, self.rank, self.world = gov, out, rank, world
        self.predicted_stop_step = predicted_stop_step
        self.ended = ""
        """The stop reason of a resumed run that the governor had already ended, else ""."""
        self._noted = False

    @classmethod
    def for_run(cls, plan, governor: Governor | None = None, *, record=None, out=None,
                rank: int = 0, world: int = 1) -> GovernedLoop:
        """The loop's governor: `governor` if given, else `Governor.for_plan(plan)` when the
        plan's `governor_threshold` is > 0, else none (inert). `record`: the resumed run's
        record, replayed into the governor (`Governor.replay`: same observations, same
        decisions, the cooldown included)."""
        if governor is None and float(getattr(plan.decisions, "governor_threshold", 0.0)) > 0:
            governor = Governor.for_plan(plan)
        loop = cls(governor, out=out, rank=rank, world=world,
                   predicted_stop_step=getattr(plan.predictions, "predicted_stop_step", None))
        if governor is not None and record is not None:
            dec = governor.replay(record.train_loss, record.heldout_loss, until=record.steps)
            loop._noted = any(n.startswith(NOTE + "stop") for n in record.notes)
            loop.ended = dec.reason if dec.end_now else ""
        return loop

    @staticmethod
    def default_eval_every(plan, governor: Governor | None = None) -> int:
        """Held-out evaluation period when `run` is given none: max_steps // 10 steps, or
        max_steps // GOVERNED_EVALS when governed (the fit needs the points)."""
        n = plan.decisions.max_steps
        on = governor is not None or float(getattr(plan.decisions, "governor_threshold", 0.0)) > 0
        return default_eval_every(n) if on else max(1, n // 10)

    @property
    def on(self) -> bool:
        return self.gov is not None

    def lr(self, step: int) -> float:
        """Multiplier of `lr_at(step, plan)` for the 0-based step `step` (the cooldown)."""
        return self.gov.lr_multiplier(step) if self.gov is not None else 1.0

    def eval_due(self, steps: int) -> bool:
        """Whether the held-out loss must be measured after `steps` steps done: at the governor's
        final step, so that the record ends with the loss at the stop."""
        return self.gov is not None and steps == self.gov.final_step

    def end(self, max_steps: int) -> int:
        """The loop's end (exclusive 0-based index): the budget, or on a resumed run that the
        governor had already ended, the step it ended at (nothing is left to run)."""
        g = self.gov
        return min(max_steps, g.final_step) if g is not None and g.final_step is not None else max_steps

    @property
    def reason(self) -> str:
        """The governor's stop reason ("" while it lets the run go on, or when off)."""
        return self.gov.summary(history=False)["reason"] if self.gov is not None else ""

    def after_step(self, rec) -> str:
        """Feed the step just done (`rec.train_loss[-1]`, and `rec.heldout_loss[-1]` when it was
        measured at `rec.steps`) and decide. Returns the stop reason when the loop must end
        now (`nan`, `diverged`, `marginal_gain` after its cooldown, `budget`), else "". Notes a
        marginal-gain decision in `rec.notes` and writes `governor.json` (rank 0) after each
        evaluation and at the end."""
        g = self.gov
        if g is None:
            return ""
        steps = rec.steps
        train = float(rec.train_loss[-1][1])
        held = rec.heldout_loss[-1] if rec.heldout_loss and rec.heldout_loss[-1][0] == steps else None
        values = [train] + ([float(held[-1])] if held is not None else [])
        if self.world > 1:
            values = [float(np.mean([gather_floats(v, self.world)])) for v in values]
        g.observe_train(steps, values[0])
        if held is not None:
            g.observe_heldout(steps, values[1])
        dec = g.decide(steps)
        if dec.stop and not self._noted:
            self._noted = True
            rec.notes.append(self._note(dec, g.threshold_nats_per_step))
        if held is not None or dec.end_now:
            self.write()
        return dec.reason if dec.end_now else ""

    def _note(self, dec: Decision, threshold: float) -> str:
        what = f"{NOTE}stop ({dec.reason}) decided after {dec.steps} steps"
        if dec.reason == "marginal_gain":
            parts = [f"{name} {g[2]:.3g}" for name, g in (("fitted curve", dec.gain_per_step),
                                                          ("trend", dec.trend_per_step)) if g]
            what += (f": upper bound of the loss drop per step ({', '.join(parts)}) below the "
                     f"threshold {threshold:.3g} nats/step; " +
                     (f"cooldown to step {dec.final_step}" if dec.cooldown_start is not None else
                      "held-out loss no longer falling (trend's mean drop <= 0): ends at once, "
                      "no cooldown"))
        if self.predicted_stop_step is not None:
            what += f"; the plan predicted a stop at step {self.predicted_stop_step}"
        return what

    def write(self) -> None:
        """`out/governor.json`: `Governor.summary()` plus the plan's predicted stop (rank 0)."""
        if self.gov is None or self.out is None or self.rank != 0:
            return
        path = Path(self.out) / "governor.json"
        summary = self.gov.summary() | {"plan_predicted_stop_step": self.predicted_stop_step}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(summary, indent=1) + "\n")
        tmp.replace(path)


def pilot_curve(plan, record, *, skip_fraction: float = 0.2):
    """A finished run's held-out points as a `trainplan.costmodels.stopping.heldout_curve.PilotCurve`, to calibrate
    the planner's curve on (`trainplan.costmodels.stopping.heldout_fit.fit_heldout_curve`): the points at a constant
    learning rate (after `warmup_steps`, up to the step `trainplan.executor.apply.applied.lr_at` starts its
    cooldown, the last 20% of `max_steps`), less the first `skip_fraction` of them (default 0.2,
    the share `trainplan.executor.calibrate.law.SKIP_FRACTION` skips as warm-up; kept apart as `early_steps` and
    `early_losses`, the start the planner adds to the fitted curve); with the run's final
    held-out loss when it ran its budget out (the cooldown's gain). Unique tokens:
    `plan.data_tokens x data_fraction`, None (fresh data) when the run saw fewer tokens than
    that."""
    d, p = plan.decisions, plan.predictions
    cool_from = d.max_steps - max(1, int(0.2 * d.max_steps))
    pts = [(int(r[0]), float(r[-1])) for r in record.heldout_loss
           if d.warmup_steps < int(r[0]) <= cool_from and np.isfinite(float(r[-1]))]
    skip = int(skip_fraction * len(pts))
    early, pts = pts[:skip], pts[skip:]
    unique = float(plan.data_tokens) * float(d.data_fraction)
    fresh = record.steps * p.tokens_per_step <= unique
    done = record.stop_reason == "budget" and record.steps == d.max_steps and record.heldout_loss
    return PilotCurve(steps=tuple(float(s) for s, _ in pts), losses=tuple(v for _, v in pts),
                      tokens_per_step=float(p.tokens_per_step), unique_tokens=None if fresh else unique,
                      final_step=int(record.steps) if done else None,
                      final_loss=float(record.final_heldout_loss) if done else None,
                      early_steps=tuple(float(s) for s, _ in early), early_losses=tuple(v for _, v in early),
                      model=str(plan.model), vocab_size=int(plan.vocab_size))


__all__ = ["NOTE", "GovernedLoop", "pilot_curve"]
