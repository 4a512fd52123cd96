"""`Plan`: the solver's only product. Frozen, JSON round trip, decisions beside predictions."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from hardware_profiles.errors import PlanMismatchError

PLAN_FORMAT = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class Decisions:
    """The knobs a plan fixes (DESIGN.md, "The knobs a Plan fixes")."""

    devices: int
    """Devices the run uses (data parallel x sequence parallel)."""
    sp_degree: int
    """Ulysses sequence-parallel degree: ranks sharing one sequence."""
    dp_degree: int
    """Data-parallel degree = devices / sp_degree."""
    zero_stage: int
    """0..3: model states sharded over all `devices` (FSDP2 for 2 and 3)."""
    micro_batch: int
    """Sequences per data-parallel rank per step."""
    seq_len: int
    """Tokens per sequence (the whole sequence; each SP rank holds seq_len / sp_degree)."""
    checkpoint: tuple[str, ...]
    """Per transformer block, the checkpoint menu entry: `none`, `full`, a built-in selective
    policy (`costmodels.remat.BUILTIN`) or a solved entry named in `checkpoint_sets`."""
    precision: str
    """`fp32`, `bf16-mixed` (bf16 compute, fp32 master) or `bf16`."""
    optimizer_bits: int
    """Adam state width: 32, 16, 8 or 4 bits."""
    data_fraction: float
    """Fraction of the corpus's training windows kept."""
    data_method: str
    """How the kept subset is chosen: `random`."""
    max_tokens: int
    """Stopping budget: tokens to train (all ranks)."""
    max_steps: int
    """Stopping budget in optimizer steps = ceil(max_tokens / tokens_per_step)."""
    governor_threshold: float
    """Stop when the predicted loss drop per step falls below this (nats/step); 0 disables."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    checkpoint_sets: dict[str, list[str]] = field(default_factory=dict)
    """Solved checkpoint entries (`remat:k`) -> the node keys whose outputs they keep
    (`costmodels.remat`, e.g. `aten.mm.default#3`); the executor rebuilds each SAC policy
    from these."""
    warmup_steps: int = 20
    seed: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Predictions:
    """What the cost models predict for one device (rank) and for the run."""

    memory_bytes: dict[str, float]
    """Per-device bytes at the predicted peak by category: params, grads, optimizer,
    activations, temporaries, total."""
    memory_phase: str
    """Where in the step the peak falls."""
    memory_limit_bytes: float
    """Usable bytes per device (HBM minus the profile's reserve)."""
    step_time_s: float
    step_time_breakdown_s: dict[str, float]
    """compute, recompute, communication (seconds per step)."""
    flops_per_step: float
    """FLOPs one device executes per step, recompute included."""
    model_flops_per_step: float
    """FLOPs per step per device without recompute (for MFU)."""
    tokens_per_step: int
    """Tokens per optimizer step over all ranks."""
    total_tokens: int
    device_hours: float
    final_loss: float
    """Predicted held-out loss at the end (nats/token)."""
    mfu: float


@dataclass(frozen=True, kw_only=True, slots=True)
class SolverFacts:
    status: str
    """CP-SAT status name: OPTIMAL or FEASIBLE."""
    objective: float
    bound: float
    wall_s: float
    seed: int
    time_limit_s: float
    n_variables: int = 0
    n_constraints: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """A training plan: model, hardware, budget, decisions, predictions and solver facts."""

    model: str
    """Preset name (or the module's class name for a user model)."""
    model_n_params: int
    model_n_layers: int
    hw: str
    """Hardware profile name."""
    budget: dict[str, Any]
    data_tokens: int
    """Unique training tokens available in the corpus."""
    vocab_size: int
    decisions: Decisions
    predictions: Predictions
    solver: SolverFacts
    created: str = ""
    format: int = PLAN_FORMAT
    notes: tuple[str, ...] = field(default=())

    def to_json(self, path: str | Path | None = None) -> str:
        """JSON text of the plan; also written to `path` when given."""
        text = json.dumps(asdict(self), indent=2, sort_keys=False)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "Plan":
        """Read a plan from JSON text or a file path.

        Raises:
            PlanMismatchError: not a trainplan plan, wrong format version or missing fields.
        """
        src = str(text_or_path)
        try:
            if not src.lstrip().startswith("{"):
                src = Path(src).read_text()
            raw = json.loads(src)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PlanMismatchError(f"cannot read plan {str(text_or_path)[:200]!r}: {e}") from None
        if not isinstance(raw, dict) or raw.get("format") != PLAN_FORMAT:
            raise PlanMismatchError(
                f"not a trainplan plan of format {PLAN_FORMAT}: got format "
                f"{raw.get('format') if isinstance(raw, dict) else type(raw).__name__!r}")
        try:
            raw["decisions"] = Decisions(**{**raw["decisions"],
                                            "checkpoint": tuple(raw["decisions"]["checkpoint"])})
            raw["predictions"] = Predictions(**raw["predictions"])
            raw["solver"] = SolverFacts(**raw["solver"])
            raw["notes"] = tuple(raw.get("notes", ()))
            known = {f.name for f in fields(cls)}
            return cls(**{k: v for k, v in raw.items() if k in known})
        except (KeyError, TypeError) as e:
            raise PlanMismatchError(f"plan JSON is missing or has unexpected fields: {e}") from None
