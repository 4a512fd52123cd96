"""`Measurement`: what a user's own training loop records for trainplan's report, the same
measurements `trainplan.executor.train.run` makes (`trainplan.executor.measure.measured_step`): peak tensor memory by
category (MemTracker, the third step), FLOPs of one step (FlopCounterMode, the fourth), the wall
and CPU time of every other step, on an accelerator the allocator's peaks and kernel split; each
step's train loss and, when the loop asks, held-out losses.

    >>> with applied.measure("runs/mine") as m:      # writes runs/mine/plan.json now
    ...     for step in range(applied.max_steps):
    ...         m.step(train_step)                   # train_step() -> its loss, a float
    ...     m.evaluate(heldout_batches)              # optional: held-out loss (nats/token)
    >>> # runs/mine/record.json: `trainplan report runs/mine`, `trainplan.executor.report(plan, record, out=...)`

The record (`trainplan.executor.record.RunRecord`) is written when the block ends, however it ends, by rank 0
(a failed rank also writes `record-rank{r}.json`); on a normal end every rank must leave the
block (the per-rank peaks are gathered).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import torch

from trainplan.executor.checkpoint import is_out_of_memory
from trainplan.executor.measure import device_name, gather_floats, heldout_loss, measured_step
from trainplan.executor.record import RunRecord, same_hardware
from trainplan.planner.plan import Plan


class Applied(Protocol):
    """What a `Measurement` reads of the plan applied (`trainplan.executor.apply.applied.AppliedPlan`)."""

    plan: Plan
    model: torch.nn.Module
    optimizer: Any
    device: torch.device
    rank: int
    world: int

    def forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...


class Measurement:
    """The context `AppliedPlan.measure(out)` returns; `record` is the run's `RunRecord`."""

    def __init__(self, applied: Applied, out: str | Path):
        self.applied, self.out = applied, Path(out)
        plan = applied.plan
        dev = device_name(applied.device)
        self.record = RunRecord(model=plan.model, hw_planned=plan.hw, device=dev,
                                same_hardware=same_hardware(plan.hw, dev), world_size=applied.world)
        self._t0 = 0.0

    def __enter__(self) -> Measurement:
        self.out.mkdir(parents=True, exist_ok=True)
        if self.applied.rank == 0:
            self.applied.plan.to_json(self.out / "plan.json")
        self._t0 = time.perf_counter()
        return self

    def step(self, train_step: Callable[[], float]) -> float:
        """Run one optimizer step, `train_step()` (the caller's micro-steps, optimizer step and
        scheduler step; returns the step's loss, nats/token), measured as `trainplan.executor.train.run`
        measures its steps (`trainplan.executor.measure.measured_step`, by the step's 0-based index).
        Records its loss and the tokens trained (all ranks); returns the loss."""
        a, rec = self.applied, self.record
        loss = float(measured_step(rec.steps, lambda _step: train_step(), rec, a.device, a.model, a.optimizer))
        rec.train_loss.append((rec.steps, loss))
        rec.steps += 1
        rec.tokens = rec.steps * a.plan.predictions.tokens_per_step
        return loss

    @torch.no_grad()
    def evaluate(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Held-out loss (nats/token) over (x, y) micro-batches, each (b, s) token ids and
        next-token targets (every rank the same ones), recorded at the steps done so far
        (`trainplan.executor.measure.heldout_loss` through `AppliedPlan.forward_loss`)."""
        rec = self.record
        loss = heldout_loss(self.applied.model, list(batches), self.applied.forward_loss)
        rec.heldout_loss.append((rec.steps, rec.tokens, loss))
        return loss

    def __exit__(self, exc_type, exc, tb) -> None:
        a, rec = self.applied, self.record
        rec.wall_s = time.perf_counter() - self._t0
        max_steps = a.plan.decisions.max_steps
        if exc is not None:
            rec.stop_reason = ("out_of_memory" if is_out_of_memory(exc) else "interrupted"
                               if isinstance(exc, KeyboardInterrupt) else "error")
            rec.notes.append(f"{type(exc).__name__} in step {rec.steps}: {str(exc).strip()[:300]}")
        elif rec.train_loss and not math.isfinite(rec.train_loss[-1][1]):
            rec.stop_reason = "nan"
        else:
            rec.stop_reason = "budget" if rec.steps >= max_steps else "interrupted"
            if rec.steps < max_steps:
                rec.notes.append(f"the loop ended after {rec.steps} of {max_steps} steps")
            rec.per_rank_peak_bytes = gather_floats(rec.peak_memory_bytes.get("total", 0.0), a.world)
        rec.notes.append("measured in the user's own loop (trainplan.executor.apply.measuring.Measurement)")
        if a.rank == 0 or exc is not None:
            rec.to_json(self.out / ("record.json" if a.rank == 0 else f"record-rank{a.rank}.json"))
