"""The plan file format, declared once: `PlanSchema`, a strict pydantic model of the JSON
`Plan.to_json` writes, through which `Plan.from_json` reads every plan; its JSON Schema is
`docs/schemas/plan.schema.json`.

Strict (pydantic's strict mode): a number is an int or a float, never a bool or a string; whole
numbers are ints (`8.0` is not a bit width); no NaN or infinity. The fields and their meaning
are `trainplan.planner.plan`'s dataclasses (`Decisions`, `Predictions`, `SolverFacts`, `Plan`); a key a
plan of format 1 may leave out (written before the field existed) has the dataclass's default.
Relations between fields that a type cannot state are validators here (sp_degree x dp_degree =
devices, warm-up within the steps, one checkpoint entry per layer); whether the predictions
belong to the decisions is `trainplan.planner.plan.edited_layout`, which `Plan.from_json` applies after.
Why pydantic rather than checks by hand: `trainplan.errors.validation`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from trainplan.costmodels.step.precision import optimizer_bits_for

LR_MAX = 10.0
"""The largest peak learning rate a plan may hold. AdamW moves each weight by up to about `lr` per
step (Loshchilov & Hutter 2019), and LLM peaks are 1e-4 to 1e-2 (GPT-3: 6e-4, Brown et al. 2020,
table 2.1; Llama 3 8B: 3e-4): 10 is 1,000 x the largest, and diverges at once (tiny-llama's loss is
NaN at step 3, `tests/integration/test_bad_inputs.py::test_nan_loss`); 1e6 is a typo."""

__all__ = ["BlockOpsSchema", "DecisionsSchema", "PlanSchema", "PredictionsSchema", "SolverFactsSchema"]

_CONFIG = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)


def _whole(v: Any) -> Any:
    """A Literal of ints takes 8.0 and True even in strict mode: refuse what is not an int."""
    if type(v) is not int:
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return v


Count = Annotated[int, Field(ge=1)]
"""A whole number >= 1."""
NonNegative = Annotated[float, Field(ge=0)]
Names = list[str]


class BlockOpsSchema(BaseModel):
    """One entry of `trainplan.planner.plan.Decisions.checkpoint_block_ops`: a checkpointed block kind's
    layers and the ops of its captured forward."""

    model_config = _CONFIG

    layers: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    ops: Names = Field(min_length=1)
    device_type: str = Field(default="cpu", pattern=r"^[a-z_]+$")


class DecisionsSchema(BaseModel):
    """`trainplan.planner.plan.Decisions` as the plan file holds it."""

    model_config = _CONFIG

    devices: Count
    sp_degree: Count
    dp_degree: Count
    zero_stage: Annotated[Literal[0, 1, 2, 3], BeforeValidator(_whole)]
    micro_batch: Count
    grad_accum: Count = 1
    seq_len: Count
    activation_checkpoint: Names
    precision: Literal["fp32", "bf16-mixed", "bf16"]
    optimizer_bits: Annotated[Literal[32, 16, 8, 4], BeforeValidator(_whole)]
    activation_bits: Annotated[Literal[32, 16, 8], BeforeValidator(_whole)] = 32
    loss_chunks: Count = 1
    mlp_chunks: Count = 1
    offload: bool = False
    data_fraction: float = Field(gt=0, le=1)
    data_method: Literal["random", "loss", "influence", "dsir"]
    max_tokens: Count
    max_steps: Count
    governor_threshold: NonNegative = 0.0
    lr: float = Field(default=3e-3, gt=0, le=LR_MAX)
    checkpoint_sets: dict[str, Names] = {}
    checkpoint_block_ops: dict[str, BlockOpsSchema] = {}
    warmup_steps: int = Field(default=20, ge=0)
    seed: int = Field(default=0, ge=0, lt=2**63)
    selection_every_steps: int = Field(default=0, ge=0)

    @field_validator("optimizer_bits")
    @classmethod
    def _runs_at_precision(cls, v: int, info: ValidationInfo) -> int:
        precision = info.data.get("precision")
        valid = optimizer_bits_for(precision) if precision else (v,)
        if v not in valid:
            raise ValueError(f"must be {', '.join(map(str, valid[:-1]))} or {valid[-1]} at precision {precision!r}")
        return v

    @model_validator(mode="after")
    def _layout(self) -> DecisionsSchema:
        if self.sp_degree * self.dp_degree != self.devices:
            raise ValueError(f"sp_degree={self.sp_degree} x dp_degree={self.dp_degree} must equal "
                             f"devices={self.devices}")
        if self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be at most max_steps={self.max_steps} (a "
                             "solved plan warms up over a tenth of its steps, at most 20)")
        if self.seq_len % self.sp_degree:
            raise ValueError(f"sp_degree={self.sp_degree} must divide seq_len={self.seq_len}")
        if self.mlp_chunks > 1 and set(self.activation_checkpoint) - {"none", "full"}:
            raise ValueError(f"mlp_chunks={self.mlp_chunks} runs with the checkpoint entries none and full "
                             f"only, not {sorted(set(self.activation_checkpoint) - {'none', 'full'})}")
        return self


class PredictionsSchema(BaseModel):
    """`trainplan.planner.plan.Predictions` as the plan file holds it."""

    model_config = _CONFIG

    memory_bytes: dict[str, NonNegative]
    memory_phase: str
    memory_limit_bytes: NonNegative
    step_time_s: float = Field(gt=0)
    step_time_breakdown_s: dict[str, float]
    flops_per_step: NonNegative
    model_flops_per_step: NonNegative
    tokens_per_step: Count
    total_tokens: int = Field(ge=0)
    device_hours: NonNegative
    final_loss: float
    mfu: NonNegative
    predicted_stop_step: Annotated[int, Field(ge=0)] | None = None
    predicted_end_step: Annotated[int, Field(ge=0)] | None = None
    predicted_end_loss: float | None = None
    made_for: dict[str, Any] = {}
    scoring_flops: NonNegative = 0.0
    host_memory_bytes: NonNegative = 0.0
    host_memory_limit_bytes: NonNegative = 0.0
    loss_regime: str = ""
    loss_band_nats: NonNegative = 0.0
    loss_law: dict[str, Any] = {}
    loss_calibration: dict[str, Any] = {}

    @field_validator("memory_bytes")
    @classmethod
    def _with_total(cls, v: dict[str, float]) -> dict[str, float]:
        if "total" not in v:
            raise ValueError("must hold bytes by category with a total")
        return v


class SolverFactsSchema(BaseModel):
    """`trainplan.planner.plan.SolverFacts` as the plan file holds it."""

    model_config = _CONFIG

    status: str
    objective: float
    bound: float
    wall_s: NonNegative
    seed: int = Field(ge=0)
    time_limit_s: NonNegative
    n_variables: int = Field(default=0, ge=0)
    n_constraints: int = Field(default=0, ge=0)
    gap: NonNegative = 0.0


class PlanSchema(BaseModel):
    """A plan file: `trainplan.planner.plan.Plan` as `Plan.to_json` writes it (format 1)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True, title="trainplan plan")

    model: str = Field(pattern=r"\S")
    model_n_params: Count
    model_n_layers: Count
    model_n_active_params: Count | None = None
    hw: str
    budget: dict[str, float]
    data_tokens: Count
    vocab_size: Count
    decisions: DecisionsSchema
    predictions: PredictionsSchema
    solver: SolverFactsSchema
    created: str = ""
    format: Annotated[Literal[1], BeforeValidator(_whole)]
    """Required in a file (its version, read before the rest); `Plan`'s default in Python."""
    notes: Names = []
    warnings: Names = []
    hf_config: dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    """`trainplan.planner.options.SolveOptions.recorded`: informational, not read back into a solve."""

    @field_validator("hf_config")
    @classmethod
    def _names_a_model_type(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and not (isinstance(v.get("model_type"), str) and v["model_type"].strip()):
            raise ValueError("must be a transformers config object with a model_type string, or null")
        return v

    @model_validator(mode="after")
    def _one_entry_per_layer(self) -> PlanSchema:
        n = len(self.decisions.activation_checkpoint)
        if n != self.model_n_layers:
            raise ValueError(f"activation_checkpoint has {n} entries, must be one name per layer "
                             f"({self.model_n_layers})")
        for kind, entry in self.decisions.checkpoint_block_ops.items():
            if max(entry.layers) >= n:
                raise ValueError(f"checkpoint_block_ops[{kind!r}] names layer {max(entry.layers)}, the model has "
                                 f"{n} layers (0 to {n - 1})")
        return self
