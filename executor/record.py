"""`RunRecord`: what a real training run measured. Written as JSON as the run goes, so an
interrupted run keeps what it measured; a resumed run appends to it."""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainplan.errors import TrainplanError
from trainplan.hardware_profiles import load as load_profile


@dataclass(kw_only=True, slots=True)
class RunRecord:
    """Measurements of one run (rank 0's view; `per_rank_peak_bytes` has every rank's total)."""

    model: str
    hw_planned: str
    """The profile the plan was made for."""
    device: str
    """Where it ran, e.g. `cpu`, `cuda:0 (NVIDIA H200)`."""
    same_hardware: bool
    """True when the run's device is the plan's target, so times are comparable (`same_hardware`)."""
    world_size: int = 1
    steps: int = 0
    tokens: int = 0
    step_times_s: list[float] = field(default_factory=list)
    step_cpu_times_s: list[float] = field(default_factory=list)
    """CPU seconds this process used in each timed step (`time.process_time`, all threads),
    beside its wall time. With one torch thread on a CPU it is the step's time without the
    other processes of a shared machine (they take wall time, not this process's CPU time)."""
    train_loss: list[tuple[int, float]] = field(default_factory=list)
    """(step, loss) for every step."""
    heldout_loss: list[tuple[int, int, float]] = field(default_factory=list)
    """(step, tokens so far, held-out loss)."""
    loss_forecast: list[tuple[int, float, float]] = field(default_factory=list)
    """(steps done, forecast final held-out loss, band half-width), nats/token, after each held-out
    evaluation once the run has enough points: the run as its own pilot
    (`trainplan.executor.reporting.forecast.online_forecast`). Empty in records written before it."""
    peak_memory_bytes: dict[str, float] = field(default_factory=dict)
    """Tensor bytes per category at the measured peak: params, grads, optimizer, activations,
    temporaries, total (MemTracker on CPU; on an accelerator only total: the largest
    max_memory_allocated of any step, `trainplan.executor.measure.record_device_memory`)."""
    step_max_allocated_bytes: list[float] | None = None
    """On an accelerator (CUDA, ROCm, ...), per timed step (`step_times_s`, in the same order):
    `torch.accelerator.max_memory_allocated` over that step, the peak statistics reset before
    it, bytes. None on CPU and in records written before it was measured."""
    step_max_reserved_bytes: list[float] | None = None
    """Per timed step, as `step_max_allocated_bytes`: `max_memory_reserved`, bytes held by the
    caching allocator (allocated plus its cached blocks and fragmentation). None on CPU."""
    device_memory_bytes: dict[str, float] | None = None
    """On an accelerator, after the latest step: `total` (what the driver exposes, the free
    and total of `get_memory_info`), `used` (total - free: every process's allocations, the
    runtime context and communication buffers included) and `reserved` (this process's caching
    allocator at that moment), bytes. None on CPU."""
    kernel_time_s: dict[str, float] | None = None
    """On an accelerator, device time per step from `torch.profiler` over the profiled steps
    (`trainplan.executor.kernels.PROFILED_STEPS`), mean per step, seconds: `matmul` (GEMM and attention
    kernels), `communication` (NCCL/RCCL kernels), `other` (elementwise, reductions, copies),
    `busy` (time any kernel ran: overlapped kernels once), `wall` (the profiled step's wall
    time, profiler overhead included), and `steps` (how many were profiled). None on CPU or
    when the run ended before the profiled steps (`trainplan.executor.kernels.split_kernels`)."""
    per_rank_peak_bytes: list[float] = field(default_factory=list)
    flops_per_step: float = 0.0
    """FLOPs of one step on this rank, by `FlopCounterMode`."""
    stop_reason: str = ""
    """Why the run ended: `budget` (all planned steps), `marginal_gain` (the compute governor
    stopped it: the next steps were not worth their cost), `interrupted` (SIGINT/SIGTERM;
    resume with `trainplan run --out DIR --resume`), `nan`, `diverged`, `out_of_memory` or
    `error`; empty while it runs."""
    wall_s: float = 0.0
    """Training wall time, all segments of a resumed run together."""
    selection_flops: float = 0.0
    """FLOPs spent scoring the data for the plan's `data_method` (`trainplan.executor.data.selection`: reference
    training and scoring passes; dynamic selection adds each re-score), charged to the budget
    beside `flops_per_step * steps`; the same on a cache hit (the compute the scores cost). 0 for
    `random`. Records written before the field read 0."""
    checkpoint: str = ""
    """The newest checkpoint directory of the run (`RUN_DIR/checkpoint/step-N`), if any."""
    notes: list[str] = field(default_factory=list)

    @property
    def median_step_time_s(self) -> float:
        """Median step wall time after the first two (warm-up) steps."""
        xs = sorted(self.step_times_s[2:] or self.step_times_s)
        return xs[len(xs) // 2] if xs else float("nan")

    @property
    def median_step_cpu_time_s(self) -> float:
        """Median CPU seconds per step after the first two timed steps (`step_cpu_times_s`);
        NaN for records written before it was measured."""
        xs = sorted(self.step_cpu_times_s[2:] or self.step_cpu_times_s)
        return xs[len(xs) // 2] if xs else float("nan")

    @property
    def max_allocated_bytes(self) -> float:
        """Largest `step_max_allocated_bytes` over the timed steps; NaN when not measured."""
        return max(self.step_max_allocated_bytes or [math.nan])

    @property
    def max_reserved_bytes(self) -> float:
        """Largest `step_max_reserved_bytes` over the timed steps; NaN when not measured."""
        return max(self.step_max_reserved_bytes or [math.nan])

    @property
    def final_heldout_loss(self) -> float:
        return self.heldout_loss[-1][2] if self.heldout_loss else float("nan")

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(asdict(self), indent=2)
        if path is not None:
            tmp = Path(str(path) + ".tmp")
            tmp.write_text(text + "\n")
            tmp.replace(path)
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> RunRecord:
        src = str(text_or_path)
        if not src.lstrip().startswith("{"):
            src = Path(src).read_text()
        raw = json.loads(src)
        raw["train_loss"] = [tuple(x) for x in raw.get("train_loss", [])]
        raw["heldout_loss"] = [tuple(x) for x in raw.get("heldout_loss", [])]
        raw["loss_forecast"] = [tuple(x) for x in raw.get("loss_forecast", [])]
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in raw.items() if k in known})  # newer fields are skipped


def same_hardware(plan_hw: str, device: str) -> bool:
    """Whether a run on `device` (as a record names it, `trainplan.executor.measure.device_name`: `cpu`,
    `cuda:0 (NVIDIA H200)`) runs on the hardware the plan's profile `plan_hw` describes, so that
    its times compare with the plan's: a CPU for `cpu`; an accelerator of the profile's device
    type whose name contains the profile's name (`NVIDIA H200` for `h200`, `AMD Instinct MI300X`
    for `mi300x`; spaces, dashes and underscores ignored). False for a profile
    `trainplan.hardware_profiles.load` does not know by name (one read from a file)."""
    kind = device.split(" ")[0].split(":")[0]
    if kind == "cpu" or plan_hw == "cpu":
        return kind == "cpu" and plan_hw == "cpu"
    try:
        profile = load_profile(plan_hw)
    except TrainplanError:
        return False
    squeeze = re.compile(r"[\s_-]")
    return profile.device_type == kind and squeeze.sub("", profile.name.lower()) in squeeze.sub("", device.lower())
