"""Pilot runs for a local loss law: what they may cost, which to run, and the law fitted to them.

Pure (numpy/scipy). `trainplan.planner.pilots` runs the pilots this module designs and caches the fit.

**The pilot-cost rule** (`PILOT_BUDGET_FRAC`, `design_pilots`): pilots may cost at most 10% of the
plan's budget, in the budget's own unit (FLOPs, or seconds for a wall-clock budget); the
planner charges what they cost to the budget before it solves. Where 10% does not buy every
pilot `MIN_PILOT_STEPS` optimizer steps, no pilots run and the published law is used.

**The pilots** (`design_pilots`): short runs of the plan's model, sequence and learning rate,
each with the executor's warmup-stable-decay schedule and the plan's warmup (20 steps, the
default of every plan long enough to afford pilots; at most a quarter of the pilot), so that
their constant-rate curves are the plan's own start (a pilot with its own shorter default warmup
ran 0.1 nats below the longer one at the same step, more than the warmup's lost area says), on
different seeds, and evaluated on `PILOT_EVAL_TOKENS` held-out tokens from `FIT_FROM` of its steps
on, about `EVALS_PER_PILOT` times in all (counted in its cost). Its final loss is a final loss,
after a cooldown, like the plan's:
- pilot-a at the smallest offered micro-batch, 6% of the budget;
- pilot-b, 4% of the budget, at the largest offered micro-batch that is at least
  `MIN_BATCH_RATIO` times the smallest and still gets `MIN_PILOT_STEPS` steps (it measures what a
  larger batch costs: the critical batch is fitted); where none is, at the smallest too, a
  shorter run (a second final point; the critical batch is then Kaplan et al.'s, carried per
  byte: a batch lever under 4x measured noise, not B_crit, on this repo's pilots).

**The fit** (`fit_pilot_law`): one model size, so Hoffmann et al. 2022's A / N^alpha is a
constant folded into E. Held-out points of a pilot at steps done s, batch g tokens, warmup w:

    constant learning rate (from FIT_FROM of the steps and 2w on, before the cooldown):
                                                             L = E + B_c X^-beta
    final (after the cooldown):                              L = E + (1 - gamma) B_c X^-beta
    X = (s - w / 2) g / (1 + g / B_crit)

X is `LossLaw.predict`'s counted tokens: the warmup's lost half (the learning-rate area,
Tissue et al. 2024, arXiv:2408.11029) and the batch's efficiency (Kaplan et al. 2020 Sec. 5.1,
B_crit fitted here). gamma is the share of the remaining excess loss the cooldown removes
(an assumption of this module: the cooldown's gain is proportional to the excess; Hägele et al.
2024, arXiv:2405.18392, measure that a cooldown of 20% of the steps matches a cosine run's final
loss). The returned law predicts final losses: B = (1 - gamma) B_c. Least squares in nats
(`scipy.optimize.least_squares`, trust-region reflective, from a grid of starts), final points
weighted `FINAL_WEIGHT` times. Its band is the RMS residual of the final points, at least
`MIN_BAND_FRAC` of the loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares

from trainplan.costmodels.checks import check_positive
from trainplan.costmodels.loss.law import LossLaw
from trainplan.costmodels.loss.planned import MAX_DEFAULT_WARMUP_STEPS, warmup_steps_for
from trainplan.errors import TrainplanError

PILOT_BUDGET_FRAC = 0.10
"""Pilots cost at most this share of the plan's budget (issue #23's rule)."""
PILOT_SHARES = (0.06, 0.04)
"""The budget shares of the two pilots: the smallest micro-batch, a larger one."""
MIN_PILOT_STEPS = 40
"""Fewest optimizer steps a pilot needs for a curve past its warmup."""
FINAL_WEIGHT = 3.0
"""Weight of a pilot's final (after-cooldown) point against one constant-rate point."""
MIN_BAND_FRAC = 0.01
"""The band of a fitted law is at least this share of the loss."""
LARGE_BATCH_TOKENS = 1e12
"""Stand-in critical batch of a fit at one batch size (no batch term: E_min = E)."""
EVALS_PER_PILOT = 8
"""Held-out evaluations a pilot makes at most, its last included (what its cost counts)."""
FIT_FROM = 0.3
"""Share of a pilot's steps before its first fitted (and first periodic) evaluation: the start of
a curve (warmup, the loss spike after it, the unigram plateau) is not a power law."""
MIN_BATCH_RATIO = 4
"""pilot-b's micro-batch is at least this multiple of pilot-a's, or it is pilot-a's."""
PILOT_EVAL_TOKENS = 4096
"""Held-out tokens of each pilot evaluation (the plan's own runs use `trainplan.executor.train.EVAL_TOKENS`)."""
FORWARD_SHARE = 1.0 / 3.0
"""An evaluation's forward pass costs this share of a training step on the same tokens (the
backward is about twice the forward: Kaplan et al. 2020, Sec. 2.1, C = 6N per token, 2N of it forward)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PilotSpec:
    """One pilot run to make."""

    name: str
    micro_batch: int
    steps: int
    tokens_per_step: int
    cost: float
    """The pilot's cost in the budget's unit (FLOPs, seconds): its steps and its evaluations'
    forward passes (`FORWARD_SHARE`)."""
    eval_tokens: int = PILOT_EVAL_TOKENS
    """Held-out tokens of each of its evaluations."""
    warmup: int | None = None
    """Its warmup, optimizer steps: the plan's (`design_pilots`); None: `warmup_steps_for(steps)`."""

    @property
    def warmup_steps(self) -> int:
        return warmup_steps_for(self.steps) if self.warmup is None else self.warmup

    @property
    def eval_from(self) -> int:
        """First periodic evaluation: `FIT_FROM` of the steps, and not before the warmup's end."""
        return max(int(FIT_FROM * self.steps), self.warmup_steps)

    @property
    def eval_every(self) -> int:
        """Five evaluations from `eval_from` to the cooldown's start, a few more in the cooldown."""
        return max(1, (self.steps - max(1, int(0.2 * self.steps)) - self.eval_from) // 4)

    def flops(self, flops_per_step: float) -> float:
        """Its FLOPs at `flops_per_step` (training steps and evaluation forwards)."""
        evals = (EVALS_PER_PILOT + 1) * self.eval_tokens / self.tokens_per_step * FORWARD_SHARE
        return (self.steps + evals) * flops_per_step


@dataclass(frozen=True, kw_only=True, slots=True)
class PilotResult:
    """A finished pilot: its held-out losses (nats/token) at steps done."""

    spec: PilotSpec
    steps: tuple[int, ...]
    losses: tuple[float, ...]
    final_loss: float
    wall_s: float = 0.0


def design_pilots(budget: float, *, cost_per_step: dict[int, float], seq_len: int) -> list[PilotSpec] | None:
    """The pilots for a plan with `budget` (FLOPs, or seconds), or None when the rule cannot buy
    them (a pilot would get fewer than MIN_PILOT_STEPS steps).

    Args: budget (> 0, the plan's unit); cost_per_step: micro-batch -> cost of one optimizer step
    at it, in the budget's unit (> 0; the offered micro-batches, without accumulation);
    seq_len (tokens per sequence).
    Raises: TrainplanError on a non-positive budget, an empty or non-positive cost table.
    """
    check_positive("budget", budget)
    if not cost_per_step:
        raise TrainplanError("cost_per_step is empty: give the cost of a step at each offered micro-batch")
    for mb, c in cost_per_step.items():
        check_positive(f"cost_per_step[{mb}]", c)
    mbs = sorted(cost_per_step)
    share_a, share_b = (share * budget for share in PILOT_SHARES)

    def eval_cost(mb: int) -> float:
        return (EVALS_PER_PILOT + 1) * PILOT_EVAL_TOKENS / (mb * seq_len) * cost_per_step[mb] * FORWARD_SHARE

    def spec(name: str, mb: int, spend: float) -> PilotSpec:
        steps = max(0, int((spend - eval_cost(mb)) // cost_per_step[mb]))
        return PilotSpec(name=name, micro_batch=mb, steps=steps, tokens_per_step=mb * seq_len,
                         cost=steps * cost_per_step[mb] + eval_cost(mb),
                         warmup=min(MAX_DEFAULT_WARMUP_STEPS, max(1, steps // 4)))

    bigger = [mb for mb in mbs[1:] if mb >= MIN_BATCH_RATIO * mbs[0]
              and spec("pilot-b", mb, share_b).steps >= MIN_PILOT_STEPS]
    out = [spec("pilot-a", mbs[0], share_a), spec("pilot-b", bigger[-1] if bigger else mbs[0], share_b)]
    if any(p.steps < MIN_PILOT_STEPS for p in out):
        return None
    return out


def _points(results: Sequence[PilotResult]) -> tuple[np.ndarray, ...]:
    """(steps minus half the warmup, batch tokens, loss, is_final) over every usable point."""
    rows: list[tuple[float, float, float, bool]] = []
    for r in results:
        w, n = r.spec.warmup_steps, r.spec.steps
        cool_start = n - max(1, int(0.2 * n))
        for step, loss in zip(r.steps, r.losses, strict=True):
            if r.spec.eval_from <= step <= cool_start:
                rows.append((step - w / 2, r.spec.tokens_per_step, loss, False))
        rows.append((n - w / 2, r.spec.tokens_per_step, r.final_loss, True))
    s, g, y, fin = zip(*rows, strict=True)
    return np.array(s, float), np.array(g, float), np.array(y, float), np.array(fin, bool)


def fit_pilot_law(results: Sequence[PilotResult], *, floor_nats: float | None = None,
                  vocab_size: int | None = None, bytes_per_token: float | None = None, source: str = ""):
    """The local law (`trainplan.costmodels.loss.law.LossLaw`, A = 0, `local=True`) fitted to the pilots
    (module docstring). Returns (law, record): the record holds the fitted constants, gamma,
    the points, residuals and the band.

    `floor_nats`: E, pinned (at most 0.9 x the lowest pilot loss): the published law's floor for
    this model size, E + A / N^alpha, carried per byte (`trainplan.planner.pilots`). Pilots span a few
    times their first fitted step and the plan lies ten to twenty times beyond: over so short a
    range a free floor and exponent trade off (on this repo's pilots the fit put E at the last
    pilot loss, a curve that stops falling), so the floor comes from the law fitted over four
    decades of model size and the pilots fit the rest. None: E is fitted too.

    Pilots all at one batch size cannot fit the critical batch: the law then keeps Kaplan et
    al.'s (`b_crit_tokens` None, carried per byte by `LossLaw.predict`).

    Raises: TrainplanError with fewer than 6 usable points or a non-finite loss.
    """
    s, g, y, fin = _points(results)
    if len(y) < 6 or not np.all(np.isfinite(y)) or np.any(y <= 0):
        raise TrainplanError(f"pilot fit needs at least 6 finite positive held-out points, got {len(y)}")
    one_batch = len(set(g.tolist())) < 2  # no lever on the critical batch: Kaplan's, not fitted
    weight = np.where(fin, FINAL_WEIGHT, 1.0)

    def unpack(th: np.ndarray) -> tuple[float, float, float, float, float]:
        e, log_b, beta, gamma = th[:4]
        return e, log_b, beta, (LARGE_BATCH_TOKENS if one_batch else math.exp(th[4])), gamma

    def model(th: np.ndarray) -> np.ndarray:
        e, log_b, beta, b_crit, gamma = unpack(th)
        x = s * g / (1.0 + g / b_crit)
        return e + np.where(fin, 1.0 - gamma, 1.0) * math.exp(log_b) * x ** -beta

    def residuals(th: np.ndarray) -> np.ndarray:
        return (model(th) - y) * weight

    lo = [0.0, -20.0, 0.02, 0.0] + ([] if one_batch else [math.log(g.min() / 100)])
    hi = [float(y.min()), 40.0, 2.0, 0.95] + ([] if one_batch else [math.log(1e9)])
    if floor_nats is not None:  # pinned (a bound of zero width keeps one code path)
        lo[0] = min(max(float(floor_nats), 0.0), 0.9 * float(y.min()))
        hi[0] = lo[0] + 1e-9
    best = None
    for e_frac in ((lo[0] / float(y.min()),) if floor_nats is not None else (0.0, 0.5, 0.8)):
        for beta0 in (0.05, 0.15, 0.35, 0.7):
            for bc0 in ((LARGE_BATCH_TOKENS,) if one_batch else (g.min(), math.sqrt(g.min() * g.max()), 10 * g.max())):
                e0 = min(max(e_frac * float(y.min()), lo[0]), hi[0])
                x0 = s * g / (1 + g / bc0)
                b0 = float(np.median(np.maximum(y - e0, 1e-6) * x0 ** beta0))
                th0 = np.clip([e0, math.log(b0), beta0, 0.1] + ([] if one_batch else [math.log(bc0)]), lo, hi)
                r = least_squares(residuals, th0, bounds=(lo, hi), method="trf", x_scale="jac")
                if best is None or r.cost < best.cost:
                    best = r
    assert best is not None  # the grid has at least one start
    e, log_b, beta, b_crit, gamma = unpack(best.x)
    res = model(best.x) - y
    band = max(float(np.sqrt(np.mean(res[fin] ** 2))), MIN_BAND_FRAC * float(np.mean(y[fin])))
    law = LossLaw(E=e, A=0.0, B=(1.0 - gamma) * math.exp(log_b), beta=beta,
                  b_crit_tokens=None if one_batch else b_crit,
                  local=True, params_range=None, tokens_range=None, band_nats=band, vocab_size=vocab_size,
                  cooldown_gain=gamma,
                  bytes_per_token=bytes_per_token or LossLaw().bytes_per_token,
                  source=source or (f"fitted to {len(results)} pilot runs ({int(fin.sum())} final and "
                                    f"{int((~fin).sum())} constant-rate held-out points; "
                                    "trainplan.costmodels.loss.pilots)"))
    record = {"E": e, "B_constant_rate": math.exp(log_b), "beta": beta,
              "b_crit_tokens": None if one_batch else b_crit,
              "gamma": gamma, "band_nats": band, "rms_nats": float(np.sqrt(np.mean(res ** 2))),
              "points": [{"x_steps": float(a), "batch_tokens": float(b), "loss": float(c), "final": bool(d),
                          "residual": float(r)} for a, b, c, d, r in zip(s, g, y, fin, res, strict=True)]}
    return law, record
