"""The compute governor's stopping rule: fit the learning curve online, stop when the next
steps are no longer worth their cost. Pure (numpy/scipy, no torch): `trainplan.executor.governor` runs it
inside the training loop (`GovernedLoop`), `Governor.replay` runs it over a record, and the
planner runs it over its predicted curve (`trainplan.costmodels.stopping.simulation.simulated_stop_step`)
to predict where it will stop.

It stops a run for one of four reasons (`Decision.reason`, also the record's `stop_reason`):

- `nan`: a train or held-out loss is NaN or infinite (at once);
- `diverged`: the smoothed train loss (EMA over `window` steps) stays above `divergence_factor`
  times its running minimum for `patience` consecutive steps;
- `marginal_gain`: a learning curve L(t) = E + A (t + t0)^-alpha fitted to the held-out losses
  (`trainplan.costmodels.stopping.curve.fit_curve`, refitted at most every `refit_every` steps, once
  `min_points` evaluations exist and a new one has arrived since the last fit) predicts that
  the next `horizon_steps` steps lower the loss by less than `threshold_nats_per_step` each,
  *even at the upper `confidence` bound* (conservative: a noisy fit delays the stop, it does
  not cause one); or the same bound on the drop per step of a
  straight line through the recent evaluations (`trend_gain`, steps >= `trend_from` x steps
  done) is below the threshold: the power law plus floor cannot rise, so a held-out loss that
  rises (overfitting on repeated data) is caught by the trend. A stop whose cooldown would
  reach the budget is not taken (it would save nothing). The run then cools down: the learning
  rate decays linearly to 5% over `cooldown_steps(s)` more steps (`cooldown_fraction` of the
  final run, 20% as `trainplan.executor.apply.applied.lr_at`'s warmup-stable-decay schedule;
  `trainplan.costmodels.stopping.schedule`) and ends at
  `Decision.final_step`. Unless the held-out loss has stopped falling: when the trend's mean
  drop per step is <= 0 at the decision (`skip_cooldown_when_rising`), the run ends at once,
  as classic early stopping does (Prechelt 1998, "Early stopping - but when?"): a cooldown
  anneals towards the repeated subset, and on the benchmark's data-constrained runs
  (`benchmarks/governor.py`, data seeds 2-4) the held-out loss after a cooldown begun on a flat or
  rising curve was higher than at the decision in 5 of 6 runs (by up to 0.06 nats), while every
  cooldown begun on a falling curve lowered it or left it level;
- `budget`: `max_steps` steps are done.

Steps are counted as *steps done* (the record's `rec.steps`, 1 after the first optimizer step),
the same axis as `RunRecord.heldout_loss`. The loop that calls it: `trainplan.executor.governor`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from trainplan.costmodels.stopping.curve import CurveFit, fit_curve, marginal_gain, trend_gain
from trainplan.costmodels.stopping.prediction import predict_stop_step
from trainplan.costmodels.stopping.schedule import COOLDOWN_FRACTION, cooldown_steps, lr_multiplier
from trainplan.errors import TrainplanError

REASONS = ("", "budget", "marginal_gain", "nan", "diverged")
"""Values of `Decision.reason` (and the record's `stop_reason`): "" while the run goes on."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    """What the governor says after a step (see the module docstring for the rules)."""

    stop: bool
    """The run is to end: at once when `end_now`, else after the cooldown, at `final_step`."""
    reason: str
    """One of REASONS: "" (go on), `budget`, `marginal_gain`, `nan`, `diverged`."""
    end_now: bool
    """The loop must stop after the step just done (steps done >= `final_step`)."""
    steps: int
    """Steps done when this decision was made."""
    cooldown_start: int | None = None
    """Steps done when the stop on marginal gain was decided = 0-based index of the first
    cooldown step; None when there is no cooldown."""
    final_step: int | None = None
    """Steps the run will have done when it ends; None while it goes on."""
    fit: CurveFit | None = None
    """The latest learning-curve fit (None before `min_points` held-out evaluations)."""
    gain_per_step: tuple[float, float, float] | None = None
    """Predicted loss drop per step over the next `horizon_steps` (mean, lower, upper),
    nats/token/step, from `fit`."""
    trend_per_step: tuple[float, float, float] | None = None
    """Drop per step of the straight line through the recent evaluations (mean, lower,
    upper), nats/token/step."""
    predicted_stop_step: int | None = None
    """Where the mean of `fit` crosses the threshold (steps done; `max_steps` if it does not)."""
    decided_at: int | None = None
    """Steps done when the stop was decided (None while the run goes on): `cooldown_start` when
    a cooldown runs, the last step when the run ends at once."""


@dataclass(kw_only=True, slots=True)
class _Stopped:
    reason: str
    decided_at: int
    cooldown_start: int | None
    final_step: int


@dataclass(kw_only=True, slots=True)
class Governor:
    """Online learning-curve fit and stopping rule for one run. Mutable; not thread-safe."""

    threshold_nats_per_step: float
    """Stop when the predicted held-out loss drop per step (upper bound) is below this,
    nats/token per step (`Decisions.governor_threshold`); 0 disables the marginal-gain rule.
    From economics: `trainplan.costmodels.stopping.prediction.threshold_from_value(value_per_nat, cost_per_step)`."""
    max_steps: int
    """Step budget: the run ends with reason `budget` when this many steps are done."""
    refit_every: int = 10
    """Refit the curve at most every this many steps (steps, >= 1), and only once a held-out
    evaluation has arrived since the last refit: between evaluations the decision cannot change
    (which lets `replay` jump from event to event)."""
    min_points: int = 8
    """Held-out evaluations needed before the first fit (>= 4)."""
    confidence: float = 0.9
    """Central confidence of the gain band; the stop waits for its upper end."""
    horizon_steps: int | None = None
    """Steps ahead over which the gain per step is averaged; None: `refit_every`."""
    fit_from: float = 0.25
    """Fit only evaluations at steps >= fit_from x (steps done) and after warm-up: the curve's
    early, pre-power-law part (warm-up, unigram plateau) would bias the tail."""
    trend_from: float = 0.5
    """The straight-line check uses evaluations at steps >= trend_from x (steps done)."""
    warmup_steps: int = 0
    """Evaluations at or before this step are never fitted."""
    t0: float | None = 1.0
    """Step offset of the fitted law (None: fitted too)."""
    cooldown_fraction: float = COOLDOWN_FRACTION
    """Share of the final run spent cooling down after a marginal-gain stop (0: stop at once)."""
    skip_cooldown_when_rising: bool = True
    """End at once, without a cooldown, when the stop is decided while the held-out loss is no
    longer falling (the trend's mean drop per step <= 0; see the module docstring)."""
    divergence_factor: float = 1.5
    """`diverged` when the smoothed train loss exceeds this x its running minimum ..."""
    patience: int = 10
    """... for this many consecutive train observations."""
    window: int = 10
    """Span (steps) of the train loss EMA that the divergence rule watches."""
    train: list[tuple[int, float]] = field(default_factory=list, init=False, repr=False)
    """(steps done, train loss) observed."""
    heldout: list[tuple[int, float]] = field(default_factory=list, init=False, repr=False)
    """(steps done, held-out loss) observed (finite ones)."""
    history: list[dict] = field(default_factory=list, init=False, repr=False)
    """One entry per refit: steps, fit parameters, gain per step (mean, lower, upper),
    predicted stop step (JSON-ready, for the record and the report)."""
    _ema: float | None = field(default=None, init=False, repr=False)
    _ema_min: float = field(default=math.inf, init=False, repr=False)
    _above: int = field(default=0, init=False, repr=False)
    _bad: str = field(default="", init=False, repr=False)
    _fit: CurveFit | None = field(default=None, init=False, repr=False)
    _fit_step: int = field(default=-(10**9), init=False, repr=False)
    _fit_seen: int = field(default=-1, init=False, repr=False)
    _gain: tuple[float, float, float] | None = field(default=None, init=False, repr=False)
    _trend: tuple[float, float, float] | None = field(default=None, init=False, repr=False)
    _pred: int | None = field(default=None, init=False, repr=False)
    _stopped: _Stopped | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        def bad(name, cond):
            if not cond:
                raise TrainplanError(f"Governor.{name}={getattr(self, name)!r} is invalid")

        thr = self.threshold_nats_per_step
        bad("threshold_nats_per_step", isinstance(thr, (int, float)) and math.isfinite(thr) and thr >= 0)
        for name, lo in (("max_steps", 1), ("refit_every", 1), ("min_points", 4), ("patience", 1),
                         ("window", 1), ("warmup_steps", 0)):
            v = getattr(self, name)
            bad(name, isinstance(v, int) and not isinstance(v, bool) and v >= lo)
        bad("horizon_steps", self.horizon_steps is None or (isinstance(self.horizon_steps, int)
                                                             and self.horizon_steps >= 1))
        bad("confidence", 0.0 < self.confidence < 1.0)
        bad("fit_from", 0.0 <= self.fit_from < 1.0)
        bad("trend_from", 0.0 <= self.trend_from < 1.0)
        bad("cooldown_fraction", 0.0 <= self.cooldown_fraction < 1.0)
        bad("skip_cooldown_when_rising", isinstance(self.skip_cooldown_when_rising, bool))
        bad("divergence_factor", self.divergence_factor > 1.0)
        bad("t0", self.t0 is None or (math.isfinite(self.t0) and self.t0 >= 0))

    @classmethod
    def for_plan(cls, plan, **overrides) -> Governor:
        """A governor with the plan's threshold (`decisions.governor_threshold`), step budget
        and warm-up; `overrides` set any other field. Reads the plan, never imports planner."""
        d = plan.decisions
        kw = dict(threshold_nats_per_step=float(d.governor_threshold), max_steps=int(d.max_steps),
                  warmup_steps=int(d.warmup_steps))
        return cls(**{**kw, **overrides})

    # -- observations ---------------------------------------------------------------------
    def observe_train(self, steps: int, loss: float) -> None:
        """A train loss (nats/token) after `steps` steps done: NaN/inf and divergence checks."""
        loss = float(loss)
        self.train.append((int(steps), loss))
        if not math.isfinite(loss):
            self._bad = self._bad or "nan"
            return
        a = 2.0 / (self.window + 1.0)
        self._ema = loss if self._ema is None else a * loss + (1.0 - a) * self._ema
        self._ema_min = min(self._ema_min, self._ema)
        self._above = self._above + 1 if self._ema > self.divergence_factor * self._ema_min else 0
        if self._above >= self.patience:
            self._bad = self._bad or "diverged"

    def observe_heldout(self, steps: int, loss: float) -> None:
        """A held-out loss (nats/token) after `steps` steps done: the points the curve is fitted
        to (NaN/inf stops the run with `nan`)."""
        loss = float(loss)
        if not math.isfinite(loss):
            self._bad = self._bad or "nan"
            return
        self.heldout.append((int(steps), loss))

    # -- the decision ---------------------------------------------------------------------
    @property
    def horizon(self) -> int:
        return self.horizon_steps or self.refit_every

    def cooldown_steps(self, steps: int) -> int:
        """Cooldown length after a stop decided with `steps` done: c such that c is
        `cooldown_fraction` of the final run, c = ceil(f / (1 - f) x steps) (25% of `steps`
        for f = 0.2); at least 1 when f > 0."""
        return cooldown_steps(steps, self.cooldown_fraction)

    def fit_points(self, steps: int, frac: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The held-out (steps, losses) the fit at `steps` done uses (from `frac` x steps on;
        default `fit_from`)."""
        lo = max((self.fit_from if frac is None else frac) * steps, self.warmup_steps + 0.5)
        pts = [(s, v) for s, v in self.heldout if s >= lo and s <= steps]
        return np.array([p[0] for p in pts], dtype=float), np.array([p[1] for p in pts], dtype=float)

    def decide(self, steps: int) -> Decision:
        """The decision after `steps` steps done (call once per step, after the observations)."""
        steps = int(steps)
        if self._stopped is None:
            if self._bad:
                self._stop(self._bad, steps, None)
            elif steps >= self.max_steps:
                self._stop("budget", steps, None)
            else:
                self._maybe_refit(steps)
                thr = self.threshold_nats_per_step
                uppers = [g[2] for g in (self._gain, self._trend) if g is not None]
                c = 0 if self.rising else self.cooldown_steps(steps)
                # a stop whose cooldown would reach the budget saves nothing: the budget decides
                if thr > 0 and uppers and min(uppers) < thr and steps + c < self.max_steps:
                    self._stop("marginal_gain", steps, steps if c else None, steps + c)
        elif self._bad in ("nan", "diverged") and self._stopped.reason not in ("nan", "diverged"):
            self._stop(self._bad, steps, None)  # a NaN during the cooldown ends the run at once
        st = self._stopped
        return Decision(stop=st is not None, reason=st.reason if st else "",
                        end_now=st is not None and steps >= st.final_step, steps=steps,
                        cooldown_start=st.cooldown_start if st else None,
                        final_step=st.final_step if st else None, fit=self._fit,
                        gain_per_step=self._gain, trend_per_step=self._trend,
                        predicted_stop_step=self._pred, decided_at=st.decided_at if st else None)

    @property
    def rising(self) -> bool:
        """The held-out loss is no longer falling (the trend's mean drop per step <= 0) and
        `skip_cooldown_when_rising` is on: a marginal-gain stop decided now ends at once."""
        return self.skip_cooldown_when_rising and self._trend is not None and self._trend[0] <= 0

    def _stop(self, reason: str, steps: int, cooldown_start: int | None, final: int | None = None) -> None:
        self._stopped = _Stopped(reason=reason, decided_at=steps, cooldown_start=cooldown_start,
                                 final_step=steps if final is None else final)

    def _maybe_refit(self, steps: int) -> None:
        if steps - self._fit_step < self.refit_every or len(self.heldout) == self._fit_seen:
            return
        # a fit attempt (kept or failed) uses the evaluations seen so far; without a new one a
        # later attempt could only lose points from the window, so none is made
        self._fit_seen = len(self.heldout)
        t, y = self.fit_points(steps)
        if t.size < self.min_points:
            return
        self._fit_step = steps
        try:
            fit = fit_curve(t, y, t0=self.t0)
        except (TrainplanError, ValueError, np.linalg.LinAlgError) as e:
            # a failed fit must not end a training run: keep the last one, say so in the history
            warnings.warn(f"governor: curve fit at step {steps} failed ({e}); keeping the last fit",
                          RuntimeWarning, stacklevel=3)
            self.history.append({"steps": steps, "n_points": int(t.size), "error": str(e)[:200]})
            return
        h = self.horizon
        mean, lo, hi = marginal_gain(fit, steps, h, self.confidence)
        self._fit, self._gain = fit, (mean / h, lo / h, hi / h)
        self._pred = (predict_stop_step(fit, self.threshold_nats_per_step, max_steps=self.max_steps,
                                        horizon_steps=h) if self.threshold_nats_per_step > 0 else None)
        tt, ty = self.fit_points(steps, self.trend_from)
        self._trend = trend_gain(tt, ty, self.confidence) if np.unique(tt).size >= 4 else None
        self.history.append({"steps": steps, "n_points": int(t.size), **fit.to_dict(),
                             "gain_per_step": list(self._gain),
                             "trend_per_step": list(self._trend) if self._trend else None,
                             "predicted_stop_step": self._pred})

    @property
    def final_step(self) -> int | None:
        """Steps the run will have done when it ends, once a stop is decided (None before):
        the loop evaluates the held-out loss when `rec.steps == gov.final_step`, so the record
        ends with the loss at the stop."""
        return self._stopped.final_step if self._stopped else None

    # -- learning rate ----------------------------------------------------------------------
    def lr_multiplier(self, step: int) -> float:
        """Multiplier of the planned learning rate for the step with 0-based index `step`: 1
        until a marginal-gain stop, then linear from 1 down to `LR_FLOOR` over the cooldown (the
        shape of `lr_at`'s own decay; `trainplan.costmodels.stopping.schedule.lr_multiplier`). Use as
        `lr_at(step, plan) * gov.lr_multiplier(step)`."""
        return lr_multiplier(step, self.state)

    @property
    def state(self) -> dict:
        """Cooldown state for `lr_multiplier`: {"cooldown_start", "final_step"} (None, None
        while no cooldown runs)."""
        st = self._stopped
        if st is None or st.cooldown_start is None:
            return {"cooldown_start": None, "final_step": None}
        return {"cooldown_start": st.cooldown_start, "final_step": st.final_step}

    # -- reporting and replay -----------------------------------------------------------------
    def curve(self, steps, confidence: float | None = None):
        """(mean, lower, upper) of the latest fit at `steps` (arrays), or None before a fit."""
        if self._fit is None:
            return None
        s = np.asarray(steps, dtype=float)
        lo, hi = self._fit.band(s, self.confidence if confidence is None else confidence)
        return self._fit.loss_at(s), lo, hi

    def summary(self, history: bool = True) -> dict:
        """JSON-ready facts for the record: reason, decision and final steps, threshold, the last
        fit, the predicted stop step and (unless `history=False`: one entry per refit, long for
        long runs) the refit history."""
        st = self._stopped
        return {"reason": st.reason if st else "", "decided_at": st.decided_at if st else None,
                "cooldown_start": st.cooldown_start if st else None,
                "final_step": st.final_step if st else None,
                "cooldown_skipped": bool(st and st.reason == "marginal_gain" and st.cooldown_start is None),
                "threshold_nats_per_step": self.threshold_nats_per_step, "max_steps": self.max_steps,
                "confidence": self.confidence, "fit": self._fit.to_dict() if self._fit else None,
                "gain_per_step": list(self._gain) if self._gain else None,
                "trend_per_step": list(self._trend) if self._trend else None,
                "predicted_stop_step": self._pred,
                "history": list(self.history) if history else []}

    def replay(self, train_loss: Iterable[tuple[int, float]] = (),
               heldout_loss: Iterable[tuple] = (), *, until: int | None = None) -> Decision:
        """Feed a recorded run (`RunRecord.train_loss` (0-based step, loss) and `.heldout_loss`
        (steps done, tokens, loss) or (steps done, loss)) step by step, deciding after each, as
        the live loop would; returns the first decision that ends the run (or the last one).
        Also rebuilds the governor's state on resume (same observations, same decisions).

        Note: a replay over a run that did not cool down when the governor says so cannot show
        the cooldown's loss drop after the decision step."""
        train = {int(s) + 1: float(v) for s, v in train_loss}
        held: dict[int, float] = {}
        for row in heldout_loss:
            held[int(row[0])] = float(row[-1])
        last = max([*train, *held, 0])
        if until is not None:
            last = min(last, int(until))
        dec = Decision(stop=False, reason="", end_now=False, steps=0)
        # decide() once per step, as the live loop does, but only at the steps where the decision
        # can change: observations, the refit due after an evaluation, the budget and the end of a
        # cooldown (between them every call is a no-op); a budget of 10^9 steps replays in an instant
        events = sorted({s for s in (*train, *held, self.max_steps) if 1 <= s <= last})
        done = 0
        for s in [*events, last + 1]:
            while (between := self._pending_step(done, s)) is not None:
                dec, done = self.decide(between), between
                if dec.end_now:
                    return dec
            if s > last:
                break
            if s in train:
                self.observe_train(s, train[s])
            if s in held:
                self.observe_heldout(s, held[s])
            dec, done = self.decide(s), s
            if dec.end_now:
                break
        return dec

    def _pending_step(self, after: int, before: int) -> int | None:
        """The first step strictly between `after` and `before` (no observation there) at which
        `decide` can change anything: the refit due after an evaluation, or the end of a
        cooldown; None when there is none."""
        if self._stopped is not None:
            end = self._stopped.final_step
            return end if after < end < before else None
        due = max(after + 1, self._fit_step + self.refit_every)
        return due if len(self.heldout) != self._fit_seen and due < before else None
