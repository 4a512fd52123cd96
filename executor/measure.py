"""What `trainplan.executor.train.run` measures besides the loss: which step is measured how
(`measured_step`: peak tensor memory by category with MemTracker, FLOPs with FlopCounterMode,
wall time; on an accelerator also each step's allocator peaks and, over
`trainplan.executor.kernels.PROFILED_STEPS`, the kernel time split), held-out loss, per-rank values
gathered to every rank, and the progress bar.

Device-agnostic: an accelerator is whatever `torch.accelerator` drives (CUDA, ROCm, XPU, ...),
told apart from the CPU by `device.type`; its memory statistics come from `torch.accelerator`'s
memory functions (`accelerator_fn`), absent on a device that has none (then not recorded).
MemTracker (about a second to import) is imported by the step it measures (`measure_memory`)."""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from trainplan.errors import require_extra
from trainplan.executor.kernels import PROFILED_STEPS, merge_splits, profile_step
from trainplan.executor.record import RunRecord
from trainplan.modeling.flop_counting import EXTRA_FLOP_FORMULAS

log = logging.getLogger(__name__)

MOD_TRACKER_WARNING = "The module hierarchy tracking maybe be messed up"
"""torch's `ModTracker` (under MemTracker) warns this when a module's forward is entered again
before it was left, as activation checkpointing's recompute does; MemTracker's peak and its
categories are unaffected (they match the prediction to 0.1% on such runs), so it goes to the log
at debug level instead of the user's terminal (issue #40, item 12)."""

WARMUP_STEPS_UNMEASURED = 2
"""Steps before the measured ones: optimizer states exist from step 1 on, so step 2 is measured
under MemTracker and step 3 under FlopCounterMode (`measured_step`)."""


def tracked_objects(model: nn.Module, opt) -> list:
    """What `MemTracker.track_external` must be given so that it sees every model state.

    MemTracker counts only storages it is told about or sees being made, so besides the model
    and the optimizer:
    - ZeRO-1's `ZeroRedundancyOptimizer` keeps this rank's states in its local optimizer
      (`opt.optim`), not in its own `state` (without it they were missed: 0 B of optimizer
      states and a peak 23% low on 2 processes);
    - FSDP2 registers a module's *whole* parameters while they are all-gathered (after a
      no-grad forward, e.g. the held-out evaluation, with `reshard_after_forward=False`), so
      `model.parameters()` may not name the shards; the optimizer's parameters are the shards
      (DTensors), added as a module's parameters so that they count as params."""
    objs = [model, opt]
    inner = getattr(opt, "optim", None)
    if isinstance(inner, torch.optim.Optimizer):
        objs.append(inner)
    known = {id(p) for p in model.parameters()}
    extra = [p for g in getattr(opt, "param_groups", ()) for p in g["params"]
             if isinstance(p, nn.Parameter) and id(p) not in known]
    if extra:
        holder = nn.Module()
        holder.shards = nn.ParameterList(extra)
        objs.append(holder)
    return objs


def measure_memory(step_fn, model, opt) -> dict[str, float]:
    """Run `step_fn()` under `MemTracker`; bytes at its peak by category: params (with buffers),
    grads, optimizer, activations, temporaries (with inputs and others), total. `model` and `opt`
    are tracked with `tracked_objects`, so sharded and ZeRO-1 states count."""
    from trainplan.modeling.torch_private import MemTracker

    mt = MemTracker()
    mt.track_external(*tracked_objects(model, opt))
    with warnings.catch_warnings(record=True) as caught, mt:
        step_fn()
    for w in caught:  # the known one to the log, any other re-issued as it came
        if issubclass(w.category, UserWarning) and MOD_TRACKER_WARNING in str(w.message):
            log.debug("torch mod_tracker: %s (%s:%s)", w.message, w.filename, w.lineno)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    snap = next(iter(mt.get_tracker_snapshot("peak").values()))
    by = {str(k).split(".")[-1]: float(v) for k, v in snap.items()}
    return {"params": by.get("PARAM", 0.0) + by.get("BUFFER", 0.0), "grads": by.get("GRAD", 0.0),
            "optimizer": by.get("OPT", 0.0), "activations": by.get("ACT", 0.0),
            "temporaries": by.get("TEMP", 0.0) + by.get("OTH", 0.0) + by.get("INP", 0.0),
            "total": by.get("Total", 0.0)}


def accelerator_fn(dev: torch.device, name: str) -> Callable[..., Any] | None:
    """`torch.accelerator.<name>` (e.g. `max_memory_allocated`, `get_memory_info`) for an
    accelerator `dev`, else the same function of its device module (`torch.cuda.<name>`, with
    `get_memory_info` spelled `mem_get_info` there) on a torch that lacks it; None on a CPU or
    when neither exists."""
    if dev.type == "cpu":
        return None
    fn = getattr(getattr(torch, "accelerator", None), name, None)
    if fn is None:
        module = getattr(torch, dev.type, None)
        fn = getattr(module, "mem_get_info" if name == "get_memory_info" else name, None)
    return fn


def _memory_stat(dev: torch.device, name: str) -> float | None:
    fn = accelerator_fn(dev, name)
    try:
        return float(fn(dev)) if fn is not None else None
    except (RuntimeError, ValueError, TypeError):  # a device type without memory statistics
        return None


def _reset_peaks(dev: torch.device) -> None:
    fn = accelerator_fn(dev, "reset_peak_memory_stats")
    if fn is not None:
        with contextlib.suppress(RuntimeError, ValueError, TypeError):  # a device type without them
            fn(dev)


def _synchronize(dev: torch.device) -> None:
    if dev.type != "cpu":
        torch.accelerator.synchronize(dev)


def record_device_memory(rec: RunRecord, dev: torch.device) -> None:
    """On an accelerator: fold the allocator's peak since the last reset into
    `rec.peak_memory_bytes["total"]` (the largest so far), and note its device memory
    (`RunRecord.device_memory_bytes`: total, used by every process, reserved by this one) when
    the device reports it. Nothing on a CPU."""
    peak = _memory_stat(dev, "max_memory_allocated")
    if peak is None:
        return
    rec.peak_memory_bytes = {"total": max(peak, rec.peak_memory_bytes.get("total", 0.0))}
    info = accelerator_fn(dev, "get_memory_info")
    try:
        free, total = info(dev) if info is not None else (None, None)
    except (RuntimeError, ValueError, TypeError):
        free = total = None
    reserved = _memory_stat(dev, "memory_reserved")
    if free is not None and total is not None and reserved is not None:
        rec.device_memory_bytes = {"total": float(total), "used": float(total - free), "reserved": reserved}


def measured_step(step: int, train_step, rec: RunRecord, dev: torch.device, model, opt) -> float:
    """One training step: step 2 under MemTracker (CPU), step 3 under FlopCounterMode, on an
    accelerator `trainplan.executor.kernels.PROFILED_STEPS` under torch.profiler (`RunRecord.kernel_time_s`),
    every other step timed into `rec.step_times_s` (wall) and `rec.step_cpu_times_s` (this
    process's CPU seconds, all its threads). On an accelerator the allocator's peak statistics
    are reset before every step and read after it: the timed steps' into
    `rec.step_max_allocated_bytes` / `step_max_reserved_bytes`, every step's largest into
    `rec.peak_memory_bytes["total"]` (`record_device_memory`). Returns its loss."""
    accel = dev.type != "cpu"
    if accel:
        _synchronize(dev)
        _reset_peaks(dev)
    if step == WARMUP_STEPS_UNMEASURED and not accel:
        losses = []
        rec.peak_memory_bytes = measure_memory(lambda: losses.append(train_step(step)), model, opt)
        return losses[0]
    if step == WARMUP_STEPS_UNMEASURED + 1:
        fc = FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS)
        with fc:
            loss = train_step(step)
        rec.flops_per_step = float(fc.get_total_flops())
    elif accel and step in PROFILED_STEPS:
        loss, split = profile_step(lambda: train_step(step), dev)
        if split is not None:
            rec.kernel_time_s = merge_splits(rec.kernel_time_s, split)
    else:
        _synchronize(dev)
        t0, c0 = time.perf_counter(), time.process_time()
        loss = train_step(step)
        _synchronize(dev)
        rec.step_times_s.append(time.perf_counter() - t0)
        rec.step_cpu_times_s.append(time.process_time() - c0)
        allocated, reserved = _memory_stat(dev, "max_memory_allocated"), _memory_stat(dev, "max_memory_reserved")
        if accel and allocated is not None and reserved is not None:
            rec.step_max_allocated_bytes = [*(rec.step_max_allocated_bytes or []), allocated]
            rec.step_max_reserved_bytes = [*(rec.step_max_reserved_bytes or []), reserved]
    if accel:
        _synchronize(dev)
        record_device_memory(rec, dev)
    return loss


@torch.no_grad()
def heldout_loss(model: nn.Module, batches, forward_loss) -> float:
    """Mean cross-entropy (nats/token) over fixed held-out batches (same on every rank)."""
    was = model.training
    model.eval()
    losses = [forward_loss(x, y).item() for x, y in batches]
    model.train(was)
    return sum(losses) / len(losses)


def gather_floats(value: float, world: int) -> list[float]:
    """`value` of every rank, in rank order (a collective when world > 1)."""
    if world == 1:
        return [value]
    out: list = [None] * world
    dist.all_gather_object(out, value)
    return [float(v) for v in out]


def any_rank(flag: bool, world: int) -> bool:
    """True on every rank when `flag` is true on any rank (a collective when world > 1; a CPU
    tensor, so it goes through gloo also on accelerators)."""
    if world == 1:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def device_name(dev: torch.device) -> str:
    """How a record names the device: `cpu`, or for an accelerator the device with its name
    when its device module gives one, e.g. `cuda:0 (NVIDIA H100 80GB HBM3)`."""
    get_name = getattr(getattr(torch, dev.type, None), "get_device_name", None) if dev.type != "cpu" else None
    if get_name is not None:
        try:
            return f"{dev} ({get_name(dev)})"
        except (RuntimeError, AssertionError, ValueError):  # no such device here
            pass
    return str(dev)


def progress_bar(total: int, enabled: bool, initial: int = 0, file=None):
    """The training progress on `file` (default stderr): a tqdm bar when it is a terminal; when
    it is not (a log file, a pipe, CI), a plain line now and then (`LogProgress`), so that logs
    show signs of life without carriage-return noise (tqdm redraws its line with carriage
    returns on any stream); nothing at all when not `enabled`. tqdm is imported for the bar alone
    (`trainplan[run]`; MissingExtraError without it)."""
    stream = file if file is not None else sys.stderr
    if not enabled:
        return LogProgress(total, initial=initial, file=None)
    if not _is_tty(stream):
        return LogProgress(total, initial=initial, file=stream)
    tqdm = require_extra("tqdm.auto", "run", "the training progress bar").tqdm
    return tqdm(total=total, initial=initial, desc="train", unit="step", leave=False, file=stream)


def _is_tty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class LogProgress:
    """The progress bar's stand-in on a stream that is not a terminal: one line per ~10% of the
    steps or per `every_s` seconds, whichever comes first, and one at the end if the last line
    was not already there, e.g. `train: step 30/300 (10%), loss 3.412, 12.3 s`. The calls are
    the tqdm bar's it replaces; a postfix is shown from the next line on, so set it before
    `update` (as with tqdm's `set_postfix(..., refresh=False)`). `file=None`: silent."""

    def __init__(self, total: int, *, initial: int = 0, file, every_s: float = 30.0,
                 fraction: float = 0.1, desc: str = "train"):
        self.total, self.n, self.file, self.desc = total, initial, file, desc
        self.every_s, self.step_every = every_s, max(1, math.ceil(total * fraction))
        self.postfix: dict[str, str] = {}
        self.t0 = self.t_last = time.perf_counter()
        self.n_last = initial

    def set_postfix(self, refresh: bool = True, **kw) -> None:
        self.postfix = {k: str(v) for k, v in kw.items()}

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if self.n // self.step_every > self.n_last // self.step_every or now - self.t_last >= self.every_s:
            self._line(now)

    def close(self) -> None:
        if self.n != self.n_last:
            self._line(time.perf_counter())

    def _line(self, now: float) -> None:
        self.t_last, self.n_last = now, self.n
        if self.file is None:
            return
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        extra = "".join(f", {k} {v}" for k, v in self.postfix.items())
        print(f"{self.desc}: step {self.n}/{self.total}{pct}{extra}, {now - self.t0:.1f} s",
              file=self.file, flush=True)
