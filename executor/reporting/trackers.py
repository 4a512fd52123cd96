"""Experiment trackers: the scalars a run's `RunRecord` holds, reported to TensorBoard, wandb or
trackio while it trains (`trainplan.executor.train.run`'s `trackers`, `trainplan run --tensorboard DIR`).

Which trackers a run reports to is a `TrackerSpec`; `open_trackers` opens them on rank 0 (other
ranks report nothing) and returns a `RunTrackers`, which the run loop calls after every step
(`RunTrackers.log`) and when the run ends, however it ends (`RunTrackers.close`). Each call
reports what the record gained since the last one, so the tracker holds the record's own numbers
(`step_scalars`), and flushes, so that an interrupted or killed run loses nothing it reported.

Scalars, the x axis the optimizer steps done (`RunRecord.steps`; the record's `train_loss` keeps
the 0-based step index, so its `(s, loss)` is logged at s + 1):

- `train/loss_nats` every step; `train/tokens` (all ranks) every step;
- `heldout/loss_nats` at each evaluation;
- `time/step_s`, `time/step_cpu_s` for each timed step (`trainplan.executor.measure.measured_step`);
- `memory/peak_bytes` when the measured peak (`RunRecord.peak_memory_bytes["total"]`) changes; on
  an accelerator `memory/step_max_allocated_bytes`, `memory/step_max_reserved_bytes` per timed step;
- predicted beside measured at each evaluation and at the end (`comparison_scalars`): for each
  term of `trainplan.executor.reporting.compare.compare`, `predicted/<term>` and `measured/<term>` (the
  latter when measured) and `rel_err/<term>`, the term named with its unit (`peak_memory_bytes`,
  `step_time_s`, `final_loss_nats`, `flops_per_step`, `tokens`, ...).

TensorBoard is `torch.utils.tensorboard.SummaryWriter` (the `tensorboard` package: extra
`trainplan[tensorboard]`); wandb and trackio (extras `trainplan[wandb]`, `trainplan[trackio]`)
are imported only when asked for. A tracker that is not installed is a `MissingExtraError`
naming the extra, raised before the run starts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from trainplan.errors import MissingExtraError, OutputPathError, TrainplanError, require_extra
from trainplan.executor.record import RunRecord
from trainplan.executor.reporting.compare import compare
from trainplan.planner.plan import Plan

__all__ = ["Cursor", "RunTrackers", "TrackerSpec", "comparison_scalars", "open_trackers", "step_scalars"]

FLAGS = {"tensorboard": "--tensorboard", "wandb": "--wandb-project", "trackio": "--trackio-project"}
"""Each tracker's command-line flag (`trainplan run`, `trainplan demo`, `trainplan.executor.worker`); the
tracker's name is also its package and its trainplan extra."""

UNIT_SUFFIX = {"bytes": "_bytes", "s": "_s", "nats": "_nats"}
"""What `comparison_scalars` appends to a `compare` term of that unit; FLOPs, tokens and steps
terms (`flops_per_step`, `tokens`, `end_step`) already say their unit."""


@dataclass(frozen=True, slots=True)
class TrackerSpec:
    """Which trackers a run reports to; all None: none.

    tensorboard: folder of TensorBoard event files (made if missing; `tensorboard --logdir DIR`).
    wandb_project, trackio_project: the wandb or trackio project the run is logged under (its
        run name is the run folder's name; wandb's own files go into the run folder).
    """

    tensorboard: str | None = None
    wandb_project: str | None = None
    trackio_project: str | None = None

    @classmethod
    def from_args(cls, args: Any) -> TrackerSpec | None:
        """From parsed `--tensorboard`, `--wandb-project`, `--trackio-project` (absent ones are
        None); None when none is given."""
        spec = cls(*(getattr(args, k, None) for k in ("tensorboard", "wandb_project", "trackio_project")))
        return spec if spec.names else None

    def given(self) -> dict[str, str]:
        """The trackers asked for, by name (`FLAGS`'s keys): the folder or project of each."""
        values = {"tensorboard": self.tensorboard, "wandb": self.wandb_project, "trackio": self.trackio_project}
        return {k: v for k, v in values.items() if v is not None}

    @property
    def names(self) -> tuple[str, ...]:
        """The trackers asked for, of `tensorboard`, `wandb`, `trackio`."""
        return tuple(self.given())

    def check(self) -> None:
        """Check before a run that each tracker asked for can start.

        Raises:
            TrainplanError: an empty folder or project name.
            MissingExtraError: a tracker's package is not installed (the message names the
                extra that installs it).
        """
        for name, value in self.given().items():
            if not str(value).strip():
                raise TrainplanError(f"{FLAGS[name]} is empty; give a "
                                     f"{'folder' if name == 'tensorboard' else 'project name'} or leave it out")
            if importlib.util.find_spec(name) is None:
                raise MissingExtraError(f"{FLAGS[name]} needs {name}, which is not installed: pip install "
                                        f"'trainplan[{name}]' (or leave {FLAGS[name]} out)")

    def argv(self) -> list[str]:
        """The same trackers as command-line flags (`trainplan.executor.worker`'s), paths made absolute."""
        values = self.given() | ({"tensorboard": str(Path(self.tensorboard).resolve())} if self.tensorboard else {})
        return [x for name, v in values.items() for x in (FLAGS[name], v)]


# --- what is reported -------------------------------------------------------------------------


@dataclass(slots=True)
class Cursor:
    """How much of a `RunRecord` has been reported: lengths of its lists, the last peak."""

    train: int = 0
    heldout: int = 0
    timed: int = 0
    allocated: int = 0
    peak_bytes: float = 0.0

    @classmethod
    def at(cls, rec: RunRecord) -> Cursor:
        """Everything `rec` holds counted as reported (a resumed run's earlier segments)."""
        return cls(len(rec.train_loss), len(rec.heldout_loss), len(rec.step_times_s),
                   len(rec.step_max_allocated_bytes or ()), rec.peak_memory_bytes.get("total", 0.0))


def step_scalars(rec: RunRecord, cursor: Cursor) -> dict[int, dict[str, float]]:
    """What `rec` gained since `cursor` (advanced in place), by step (steps done): the scalars of
    the module docstring but the comparison. Called after every step, so the timed values of
    the step just done (step times, allocator peaks) are logged at `rec.steps`."""
    out: dict[int, dict[str, float]] = defaultdict(dict)
    for s, loss in rec.train_loss[cursor.train:]:
        out[s + 1]["train/loss_nats"] = float(loss)
    if len(rec.train_loss) > cursor.train:
        out[rec.steps]["train/tokens"] = float(rec.tokens)
    for s, _tokens, loss in rec.heldout_loss[cursor.heldout:]:
        out[s]["heldout/loss_nats"] = float(loss)
    for wall in rec.step_times_s[cursor.timed:]:
        out[rec.steps]["time/step_s"] = float(wall)
    for cpu in rec.step_cpu_times_s[cursor.timed:]:  # appended with the wall time (none in old records)
        out[rec.steps]["time/step_cpu_s"] = float(cpu)
    allocated, reserved = rec.step_max_allocated_bytes or [], rec.step_max_reserved_bytes or []
    for a, r in zip(allocated[cursor.allocated:], reserved[cursor.allocated:], strict=False):
        out[rec.steps] |= {"memory/step_max_allocated_bytes": float(a), "memory/step_max_reserved_bytes": float(r)}
    peak = float(rec.peak_memory_bytes.get("total", 0.0))
    if peak > 0 and peak != cursor.peak_bytes:
        out[rec.steps]["memory/peak_bytes"] = peak
    cursor.train, cursor.heldout, cursor.timed = len(rec.train_loss), len(rec.heldout_loss), len(rec.step_times_s)
    cursor.allocated, cursor.peak_bytes = len(allocated), peak
    return dict(out)


def comparison_scalars(plan: Plan, rec: RunRecord) -> dict[str, float]:
    """Predicted beside measured, the terms of `trainplan.executor.reporting.compare.compare(plan, rec)`:
    `predicted/<term><unit>`, and where measured `measured/<term><unit>` and `rel_err/<term><unit>`
    ((predicted - measured) / measured). Unit suffixes: `UNIT_SUFFIX`."""
    out: dict[str, float] = {}
    for r in compare(plan, rec).itertuples(index=False):
        name = f"{r.term}{UNIT_SUFFIX.get(str(r.unit), '')}"
        for kind, value in (("predicted", r.predicted), ("measured", r.measured), ("rel_err", r.rel_err)):
            if math.isfinite(float(value)):
                out[f"{kind}/{name}"] = float(value)
    return out


# --- the trackers -----------------------------------------------------------------------------


class Backend(Protocol):
    """One tracker: scalars at a step, flushed, closed."""

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class TensorBoardBackend:
    """Event files in `log_dir` by `torch.utils.tensorboard.SummaryWriter`; the plan as text."""

    def __init__(self, log_dir: str | Path, plan_json: str):
        from torch.utils.tensorboard import SummaryWriter

        try:
            self.writer = SummaryWriter(log_dir=str(log_dir))
        except OSError as e:
            raise OutputPathError(f"--tensorboard {str(log_dir)!r}: cannot write event files there "
                                  f"({e.strerror or e}); give a writable folder") from None
        self.writer.add_text("plan", f"```json\n{plan_json}\n```")

    def log(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, global_step=step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class RunLikeBackend:
    """wandb or trackio: the same calls, `module.init(project=, name=, config=)` returning a run
    with `log(metrics, step=)` and `finish()`; each log is sent (or queued by the library's own
    process) at once, so `flush` has nothing to do."""

    def __init__(self, module: str, project: str, name: str, config: dict, **init_kw):
        lib = require_extra(module, module, FLAGS[module])  # e.g. "--wandb-project needs wandb, ..."
        self.run = lib.init(project=project, name=name, config=config, **init_kw)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


class RunTrackers:
    """The trackers of one run, fed from its `RunRecord` (none: every call does nothing)."""

    def __init__(self, backends: list[Backend], plan: Plan, rec: RunRecord):
        self.backends, self.plan, self.cursor = backends, plan, Cursor.at(rec)
        self.compared_at: int | None = None
        """The step of the last `comparison_scalars` reported."""

    def pending(self, rec: RunRecord, *, final: bool = False) -> dict[int, dict[str, float]]:
        """What `rec` gained since the last call, by step (`step_scalars`; the cursor advances),
        with predicted beside measured (`comparison_scalars`) at `rec.steps` after an evaluation
        (a new held-out loss) or, when `final`, unless already reported at that step."""
        evaluated = len(rec.heldout_loss) > self.cursor.heldout
        by_step = step_scalars(rec, self.cursor)
        if evaluated or (final and self.compared_at != rec.steps):
            by_step.setdefault(rec.steps, {}).update(comparison_scalars(self.plan, rec))
            self.compared_at = rec.steps
        return by_step

    def log(self, rec: RunRecord) -> None:
        """Report what `rec` gained since the last call (`pending`) to every tracker; flushed."""
        if not self.backends:
            return
        by_step = self.pending(rec)
        for step in sorted(by_step):
            for b in self.backends:
                b.log(by_step[step], step)
        for b in self.backends:
            b.flush()

    def close(self, rec: RunRecord) -> None:
        """At the end of the run, however it ends: report what is left (`pending`, final), then
        close every tracker. Never raises: a tracker that fails here is a warning (the run's
        record is written after this, and the run's own error comes first)."""
        backends, self.backends = self.backends, []
        if not backends:
            return
        try:
            by_step = self.pending(rec, final=True)
        except Exception as e:
            warnings.warn(f"the run's last scalars were not reported: {e}", RuntimeWarning, stacklevel=2)
            by_step = {}
        for b in backends:
            try:
                for step in sorted(by_step):
                    b.log(by_step[step], step)
            except Exception as e:
                warnings.warn(f"{type(b).__name__}: the run's last scalars were not reported: {e}",
                              RuntimeWarning, stacklevel=2)
            try:
                b.close()
            except Exception as e:
                warnings.warn(f"{type(b).__name__} did not close: {e}", RuntimeWarning, stacklevel=2)


def open_trackers(spec: TrackerSpec | None, plan: Plan, rec: RunRecord, *, out: str | Path,
                  rank: int = 0) -> RunTrackers:
    """The trackers `spec` names, opened for the run in folder `out` whose record is `rec` (a
    resumed run's earlier steps count as reported); none when `spec` is None or on a rank
    other than 0.

    Raises:
        TrainplanError, MissingExtraError: as `TrackerSpec.check`.
        OutputPathError: the TensorBoard folder cannot be written.
    """
    if spec is None or rank != 0 or not spec.names:
        return RunTrackers([], plan, rec)
    spec.check()
    text, name = plan.to_json(), Path(out).resolve().name
    config = json.loads(text)
    backends: list[Backend] = []
    try:
        if spec.tensorboard:
            backends.append(TensorBoardBackend(spec.tensorboard, text))
        if spec.wandb_project:
            backends.append(RunLikeBackend("wandb", spec.wandb_project, name, config, dir=str(out)))
        if spec.trackio_project:
            backends.append(RunLikeBackend("trackio", spec.trackio_project, name, config))
    except BaseException:
        for b in backends:  # the ones already opened
            with contextlib.suppress(Exception):
                b.close()
        raise
    return RunTrackers(backends, plan, rec)
