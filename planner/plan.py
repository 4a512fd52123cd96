"""`Plan`: the solver's only product. Frozen, JSON round trip, decisions beside predictions."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from trainplan.errors import PlanMismatchError
from trainplan.errors.validation import one_line
from trainplan.planner.plan_schema import PlanSchema

PLAN_FORMAT = 1
_log = logging.getLogger(__name__)
RENAMED_DECISIONS = {"checkpoint": "activation_checkpoint"}
"""Decision keys renamed within plan format 1: old name -> new name (`upgraded`)."""


DEFAULT_LR = 3e-3
"""Peak learning rate of a plan's AdamW schedule unless the caller sets one (`--lr`)."""


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
    """Sequences per data-parallel rank per micro-step (one forward and backward)."""
    grad_accum: int = 1
    """Micro-steps per optimizer step (gradient accumulation): a step trains
    dp_degree x micro_batch x grad_accum sequences. Plans written before the field read 1."""
    seq_len: int
    """Tokens per sequence (the whole sequence; each SP rank holds seq_len / sp_degree)."""
    activation_checkpoint: tuple[str, ...]
    """Per transformer block, its activation checkpoint entry (what the block's forward saves for
    the backward, the rest recomputed; not a run's saved state, `trainplan.executor.checkpoint`):
    `none`, `full`, a built-in selective policy (`trainplan.costmodels.checkpoint_sets.BUILTIN`) or
    a solved entry named in `checkpoint_sets`. Plan files written before the name read their
    `checkpoint` key here (`upgraded`, with a one-line deprecation note)."""
    precision: str
    """`fp32`, `bf16-mixed` (bf16 compute, fp32 master) or `bf16`."""
    optimizer_bits: int
    """Adam state width: 32 (fp32, torch), 16 (the pure-bf16 parameters' dtype, torch), 8
    (bitsandbytes block-wise) or 4 (torchao block-wise) bits (`trainplan.executor.optimizers`)."""
    activation_bits: int = 32
    """Width of the activations autograd saves for the backward outside checkpointed blocks:
    32 = as computed, 16 = bf16, 8 = int8 with a per-channel scale
    (`trainplan.modeling.activation_compression`). Plans written before the field read 32."""
    loss_chunks: int = 1
    """Sequence chunks the LM head and loss run over (`trainplan.modeling.tiling.tiled_lm_loss`: one
    chunk's logits alive at a time, recomputed in the backward); 1 = not tiled. Plans written
    before the field read 1."""
    mlp_chunks: int = 1
    """Sequence chunks every block's MLP runs over (`trainplan.modeling.tiling.tile_mlp`); 1 = not tiled.
    Above 1, blocks are checkpointed `none` or `full`. Plans written before the field read 1."""
    offload: bool = False
    """Checkpointed blocks' inputs kept in host memory from their forward to their backward
    (`trainplan.modeling.offload`). Plans written before the field read False."""
    data_fraction: float
    """Fraction of the corpus's training windows kept."""
    data_method: str
    """How the kept subset is chosen: `random` (a seeded uniform subset), or a scoring method of
    `trainplan.executor.data.selection`: `loss` (a small reference model's per-window loss), `influence`
    (LESS-style gradient similarity to a held-out target slice) or `dsir` (hashed n-gram
    importance weights toward that slice). Chosen with `data_fraction` by
    `trainplan.planner.data_choice.choose_data_method`."""
    max_tokens: int
    """Stopping budget: tokens to train (all ranks)."""
    max_steps: int
    """Stopping budget in optimizer steps = ceil(max_tokens / tokens_per_step)."""
    governor_threshold: float = 0.0
    """Stop when the predicted held-out loss drop per step falls below this (nats/token per
    step); 0 disables the compute governor (`trainplan.executor.governor`). Set by
    `trainplan.planner.governor.with_governor`: cost of one step / value of one nat."""
    lr: float = DEFAULT_LR
    """Peak learning rate (AdamW)."""
    checkpoint_sets: dict[str, list[str]] = field(default_factory=dict)
    """Solved checkpoint entries (`remat:k`) -> the node keys whose outputs they keep
    (`trainplan.costmodels.checkpoint_sets`, e.g. `aten.mm.default#3`); the executor rebuilds each SAC policy
    from these."""
    checkpoint_block_ops: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per checkpointed block kind (the captured region its layers run, e.g. `block0`): `layers`
    (the 0-based layers that run it checkpointed), `ops` (the ATen ops of its captured forward in
    execution order, as the SAC policy function sees them: `trainplan.costmodels.checkpoint_sets.node_keys`
    without the call counts, attention overloads as `attention`) and `device_type` (whose attention
    and dropout kernels were captured: `cpu` or `cuda`). The node keys of `checkpoint_sets` name
    positions in these sequences; `trainplan.executor.apply.checkpointing.check_block_ops` refuses a model
    whose blocks run other ops (`PlanMismatchError`). Plans written before the field read {}
    (not checked)."""
    warmup_steps: int = 20
    seed: int = 0
    selection_every_steps: int = 0
    """Data selection timing: 0 = static (score once before training, keep `data_fraction` of
    the windows for the whole run); K > 0 = dynamic (start from a seeded random subset and
    re-score every K steps with the model being trained, `trainplan.executor.data.dynamic_selection.DynamicSelector`).
    Plans written before the field read 0."""


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
    predicted_stop_step: int | None = None
    """Steps done when the governor is predicted to decide to stop: where the predicted loss
    curve's drop per step falls below `Decisions.governor_threshold`
    (`trainplan.planner.governor.with_governor`); `max_steps` when the budget binds first; None without
    a governor. Plans written before the field read None."""
    predicted_end_step: int | None = None
    """Steps done when the governed run is predicted to end: `predicted_stop_step` plus its
    cooldown (a quarter of it), or `max_steps`; None without a governor."""
    predicted_end_loss: float | None = None
    """Predicted held-out loss at `predicted_end_step` (nats/token; same law and bits penalty
    as `final_loss`, which is the loss at `max_steps`); None without a governor."""
    made_for: dict[str, Any] = field(default_factory=dict)
    """The layout decisions the memory, FLOP and time predictions were made for
    (`layout_fields`); a plan whose decisions differ was edited after its predictions and is
    refused before it runs (`edited_layout`). Plans written before the field read {} (not
    checked)."""
    scoring_flops: float = 0.0
    """FLOPs of scoring the corpus for `Decisions.data_method` (reference-model training and
    the scoring pass, `trainplan.costmodels.data.scoring.reference_scoring_flops`), charged to the budget
    before training: `max_steps` is what is left. 0 for `random`; plans written before the
    field read 0."""
    host_memory_bytes: float = 0.0
    """Host memory per device holding offloaded activations (`Decisions.offload`); 0 without."""
    host_memory_limit_bytes: float = 0.0
    """Host memory one device may fill (`trainplan.costmodels.step.offload.host_limit_bytes`); 0 on a
    unified-memory device, where offload frees nothing, and in plans written before the field."""
    loss_regime: str = ""
    """Which regime `final_loss` is in (`trainplan.costmodels.loss.law.LossLaw.regime`): "fitted locally",
    "published, inside its range", "extrapolated", or "a bound near ln(V), not a prediction" (the
    law's own value is above 0.9 ln V: `trainplan.costmodels.loss.bounds`); "" in plans written before
    the field."""
    loss_band_nats: float = 0.0
    """Half-width of `final_loss`'s band, nats/token (`LossLaw.band`); 0 in older plans."""
    loss_law: dict[str, Any] = field(default_factory=dict)
    """The loss law's constants the predictions used (`LossLaw` fields, `trainplan.costmodels.loss.cache.law_fields`),
    so the data-method choice and the governor predict with the same law; {} in older plans."""
    loss_calibration: dict[str, Any] = field(default_factory=dict)
    """How the law was obtained when `solve` calibrated it on pilot runs (`trainplan.planner.pilots`): ran
    or reused from the cache, the pilots and their FLOPs and seconds, the fit; {} when it did not."""


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
    gap: float = 0.0
    """Relative optimality gap |objective - bound| / |objective| (0 when OPTIMAL). A FEASIBLE
    plan is the best the solver found within its time limit, not proven optimal."""


def relative_gap(status: str, objective: float, bound: float) -> float:
    """|objective - bound| / max(|objective|, 1): 0 for an OPTIMAL status, else how far the best
    plan found may be from the optimum, relative to its objective (CP-SAT's own measure)."""
    if status == "OPTIMAL":
        return 0.0
    return abs(float(objective) - float(bound)) / max(abs(float(objective)), 1.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """A training plan: model, hardware, budget, decisions, predictions and solver facts."""

    model: str
    """Preset name, a config-built model's name (`trainplan.modeling.configs.config_name`), or the module's
    class name for a user model."""
    model_n_params: int
    model_n_layers: int
    model_n_active_params: int | None = None
    """Parameters one token runs through in a mixture of experts (`ModelGraph.n_active_params`);
    None for a dense model and in plans written before the field."""
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
    warnings: tuple[str, ...] = field(default=())
    """What the user should know before running the plan, one line each (e.g. a sequence beyond
    the model's `max_position_embeddings`, `trainplan.modeling.configs.position_warning`); `trainplan solve`
    prints them. Plans written before the field read ()."""
    hf_config: dict[str, Any] | None = None
    """The transformers config dict the model was built from (`trainplan.modeling.configs.build_from_config`,
    e.g. by `trainplan solve --model config.json`): `trainplan run` rebuilds the model from it.
    None for a preset (rebuilt by name) or a user's own module; plans written before the field
    read None."""
    options: dict[str, Any] | None = None
    """The `trainplan.planner.options.SolveOptions` the plan was solved with, as JSON values
    (`SolveOptions.recorded`); None for a plan not made by `solve` (`plan_for_choice`, the longest
    sequence's search) and for plans written before the field."""

    @property
    def compute_flops(self) -> float:
        """Training compute, FLOPs: model FLOPs per step per device x devices x `max_steps` (`law_lr`'s C)."""
        return self.predictions.model_flops_per_step * self.decisions.devices * self.decisions.max_steps

    @property
    def law_n_params(self) -> int:
        """The N the loss law is evaluated at: `model_n_active_params` (MoE), else `model_n_params`."""
        return self.model_n_active_params or self.model_n_params

    def __str__(self) -> str:
        """The plan as `trainplan solve` prints it (`trainplan.planner.plan_text.plan_summary`);
        `repr` stays the dataclass's, every field."""
        from trainplan.planner.plan_text import plan_summary

        return plan_summary(self)

    def to_json(self, path: str | Path | None = None) -> str:
        """JSON text of the plan; also written to `path` when given."""
        text = json.dumps(asdict(self), indent=2, sort_keys=False)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> Plan:
        """Read a plan from JSON text or a file path, validated by the plan file's schema
        (`trainplan.planner.plan_schema.PlanSchema`: types, ranges, the relations between decisions) and
        checked that its predictions were made for its decisions (`edited_layout`).

        Raises:
            PlanMismatchError: not a trainplan plan, wrong format version, or a key that is
                missing, unknown or invalid (named, with its value and what is valid); an `hw` or
                a memory prediction no device has (`implausible`).
        """
        src = str(text_or_path)
        where = "plan JSON" if src.lstrip().startswith("{") else f"plan {src!r}"
        try:
            if not src.lstrip().startswith("{"):
                src = Path(src).read_text()
            raw = json.loads(src)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise PlanMismatchError(f"cannot read plan {str(text_or_path)[:200]!r}: {why}; give a plan "
                                    "JSON file written by `trainplan solve --json`") from None
        fmt = raw.get("format") if isinstance(raw, dict) else None
        if not isinstance(raw, dict) or type(fmt) is not int or fmt != PLAN_FORMAT:
            raise PlanMismatchError(
                f"not a trainplan plan of format {PLAN_FORMAT}: got format "
                f"{raw.get('format') if isinstance(raw, dict) else type(raw).__name__!r}; give a plan "
                "written by `trainplan solve --json`")
        corrupt = "the plan file is corrupt or edited: solve it again"
        raw = upgraded(raw, where)
        try:
            p = PlanSchema.model_validate(raw)
        except ValidationError as e:
            raise PlanMismatchError(f"{where}: {one_line(e, PlanSchema)}; {corrupt}") from None
        plan = cls(**{**p.model_dump(exclude={"decisions", "predictions", "solver"}), "notes": tuple(p.notes),
                      "warnings": tuple(p.warnings)},
                   decisions=Decisions(**{**p.decisions.model_dump(),
                                         "activation_checkpoint": tuple(p.decisions.activation_checkpoint)}),
                   predictions=Predictions(**p.predictions.model_dump()), solver=SolverFacts(**p.solver.model_dump()))
        edited = edited_layout(plan) or implausible(plan)
        if edited is not None:
            raise PlanMismatchError(f"{where}: {edited}; {corrupt}")
        return plan


def upgraded(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """`raw` (a plan file's JSON object) with the decision keys renamed since it was written
    (`RENAMED_DECISIONS`) under their new names, in `decisions` and in `predictions.made_for`;
    logs one line (a warning of the `trainplan` logger) per renamed key. Unchanged when it holds
    no old name, or holds old and new together (the schema then refuses the old one as unknown)."""
    dec, pred = raw.get("decisions"), raw.get("predictions")
    if not isinstance(dec, dict):
        return raw
    old = [k for k in RENAMED_DECISIONS if k in dec and RENAMED_DECISIONS[k] not in dec]
    if not old:
        return raw
    for k in old:
        _log.warning("%s: decisions.%s is deprecated, read as decisions.%s (plans solved now write the new name)",
                     where, k, RENAMED_DECISIONS[k])
    out = {**raw, "decisions": {RENAMED_DECISIONS.get(k, k) if k in old else k: v for k, v in dec.items()}}
    if isinstance(pred, dict) and isinstance(made := pred.get("made_for"), dict):
        out["predictions"] = {**pred, "made_for": {RENAMED_DECISIONS.get(k, k) if k in old else k: v
                                                   for k, v in made.items()}}
    return out


LAYOUT_FIELDS = ("devices", "sp_degree", "dp_degree", "zero_stage", "micro_batch", "seq_len",
                 "activation_checkpoint", "checkpoint_sets", "precision", "optimizer_bits", "activation_bits",
                 "grad_accum", "loss_chunks", "mlp_chunks", "offload")
"""The decisions that set a step's memory, FLOPs and time (`Predictions.made_for`)."""


def layout_fields(d: Decisions) -> dict[str, Any]:
    """`d`'s LAYOUT_FIELDS as JSON values (tuples as lists): what `Predictions.made_for` holds."""
    out = {k: getattr(d, k) for k in LAYOUT_FIELDS}
    out["activation_checkpoint"] = list(d.activation_checkpoint)
    sets = d.checkpoint_sets
    out["checkpoint_sets"] = {k: list(v) for k, v in sets.items()} if isinstance(sets, dict) else sets
    return out


def edited_layout(plan: Plan) -> str | None:
    """Why `plan`'s predictions do not belong to its decisions, or None: the tokens a step takes
    (micro_batch x seq_len x dp_degree x grad_accum) differ from `predictions.tokens_per_step`, or a layout
    decision (`LAYOUT_FIELDS`) differs from the one `predictions.made_for` records, i.e. the
    layout was edited after the predictions (memory, time) were made, which every memory check
    then reads stale. A plan written by `solve` or `plan_for_choice` always agrees."""
    d, made = plan.decisions, plan.predictions.made_for
    tps = d.micro_batch * d.seq_len * d.dp_degree * d.grad_accum
    edited = "the decisions were edited after the predictions (memory and time) were made"
    if plan.predictions.tokens_per_step != tps:
        accum = f" x grad_accum={d.grad_accum}" if d.grad_accum != 1 else ""
        return (f"predictions.tokens_per_step={plan.predictions.tokens_per_step!r} is not "
                f"micro_batch={d.micro_batch} x seq_len={d.seq_len} x dp_degree={d.dp_degree}{accum}: {edited}")
    now = layout_fields(d)
    diffs = [f"{k}={_short(now[k])} (predicted for {_short(made[k])})"
             for k in LAYOUT_FIELDS if isinstance(made, dict) and k in made and made[k] != now[k]]
    return f"decisions.{', '.join(diffs)}: {edited}" if diffs else None


def _short(v) -> str:
    text = json.dumps(v)
    return text if len(text) <= 60 else text[:57] + "..."


HW_FROM_FILE = "hw_profile_file"
"""The `Plan.options` key `trainplan.planner.api.solve` sets (to the file) for a profile read from a
.toml file or given as a `HardwareProfile` object: its name is then not a shipped profile's."""


def implausible(plan: Plan) -> str | None:
    """Why `plan`'s hardware or memory predictions cannot be, or None. Every command that reads a
    plan file reads it through `Plan.from_json`, which calls this:

    - `hw` must be a shipped profile (`trainplan.hardware_profiles.known_names`), unless the plan
      records that it was solved with a profile file (`HW_FROM_FILE` in `Plan.options`);
    - for a shipped profile, `predictions.memory_limit_bytes` and each `predictions.memory_bytes`
      entry must be at most its device memory (`HardwareProfile.hbm_bytes`; the `cpu`
      profile's is this host's, so its plans skip the check: a plan made on another host may differ).
    """
    from trainplan.hardware_profiles import known_names, load

    names = known_names()
    if plan.hw not in names:
        if isinstance(plan.options, dict) and plan.options.get(HW_FROM_FILE):
            return None
        return (f"hw={plan.hw!r} is not a shipped hardware profile ({', '.join(names)}) and the plan does not "
                f"record a profile file (options.{HW_FROM_FILE}, which `solve --hw FILE.toml` writes)")
    if plan.hw == "cpu":
        return None
    device_bytes = float(load(plan.hw).hbm_bytes)
    p = plan.predictions
    over = [(f"predictions.memory_limit_bytes={p.memory_limit_bytes:.4g}", p.memory_limit_bytes)] + [
        (f"predictions.memory_bytes.{k}={v:.4g}", v) for k, v in p.memory_bytes.items()]
    bad = [text for text, v in over if v > device_bytes]
    if bad:
        return (f"{', '.join(bad[:3])} is more than one {plan.hw} device holds ({device_bytes:.4g} bytes, "
                f"{device_bytes / 2**30:.1f} GiB)")
    return None
