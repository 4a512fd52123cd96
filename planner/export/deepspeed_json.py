"""A plan as a DeepSpeed config JSON: batch sizes, ZeRO stage, bf16, AdamW, the warmup schedule,
Ulysses sequence parallelism, and the unexpressed decisions under a top-level `trainplan` key
DeepSpeed ignores.

Keys and meanings are DeepSpeed 0.19.8's: `deepspeed/runtime/constants.py` (`train_batch_size`,
`train_micro_batch_size_per_gpu`, `gradient_accumulation_steps`, `gradient_clipping` with 0
disabling it, `steps_per_print`), `deepspeed/runtime/precision_config.py` (`DeepSpeedBF16Config`:
`bf16.enabled`, `bf16_master_weights_and_grads`, `bf16_optimizer_states`),
`deepspeed/runtime/zero/config.py` (`DeepSpeedZeroConfig.stage`), `deepspeed/runtime/config.py`
(`optimizer.type` AdamW, `optimizer.params.torch_adam`, `sequence_parallel_size`: the Ulysses
degree that divides the data-parallel world, `DeepSpeedConfig.__init__`) and
`deepspeed/runtime/lr_schedules.py` (`WarmupLR`: `warmup_min_lr`, `warmup_max_lr`,
`warmup_num_steps`, `warmup_type`).

JSON has no comments. DeepSpeed reads the keys it knows and ignores other top-level keys
(`DeepSpeedConfig._initialize_params` reads each by name; `tests/unit/planner/test_export.py`
loads every exported file with `DeepSpeedConfig`): the plan summary and the unexpressed decisions
go under the top-level key `trainplan`.

What DeepSpeed's config cannot express, and what the file uses instead: per-block checkpoint
sets (its `activation_checkpointing` section configures `deepspeed.checkpointing.checkpoint`
calls a model makes, not which blocks), 8- and 4-bit Adam (AdamW with fp32 states), the
warmup-stable-decay schedule (WarmupLR: warmup, then the peak to the end), pure bf16 at ZeRO 0
(fp32 master weights), the sequence length, step budget and seed (the training script's).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from trainplan.planner.export.common import (
    ADAMW_BETAS,
    ADAMW_EPS,
    ADAMW_WEIGHT_DECAY,
    Export,
    NotExpressed,
    checkpoint_summary,
    data_and_stop,
    header,
    not_expressed_lines,
    optimizer_bits_note,
    schedule,
)
from trainplan.planner.plan import Decisions, Plan

VERSION = "DeepSpeed 0.19.8"
"""The DeepSpeed release whose config keys this writes."""
NOTES_KEY = "trainplan"
"""The top-level key holding the plan summary and the unexpressed decisions (DeepSpeed ignores it)."""


def _precision(d: Decisions) -> tuple[dict[str, Any], list[NotExpressed]]:
    if d.precision == "fp32":
        return {"enabled": False}, []
    if d.precision == "bf16-mixed":
        return {"enabled": True}, []
    if d.zero_stage == 0:
        return {"enabled": True}, [NotExpressed(
            "precision", "bf16 (pure)", "DeepSpeed keeps bf16 master weights and optimizer states only under "
            "ZeRO 1-3 (bf16_master_weights_and_grads); at ZeRO 0 used bf16 with fp32 master weights (more memory)",
            runs={"precision": "bf16-mixed"} | ({"optimizer_bits": 32} if d.optimizer_bits == 16 else {}))]
    return {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}, []


def ds_config(plan: Plan) -> tuple[dict[str, Any], list[NotExpressed]]:
    """The DeepSpeed config as a dict (without the `trainplan` key) and the decisions it cannot
    express."""
    d = plan.decisions
    s = schedule(d)
    bf16, notes = _precision(d)
    runs_precision = "bf16-mixed" if d.precision == "bf16" and d.zero_stage == 0 else d.precision
    bits = optimizer_bits_note(dataclasses.replace(d, precision=runs_precision), "DeepSpeed", "AdamW")
    if bits is not None:
        notes.append(NotExpressed(bits.decision, bits.planned, bits.instead + "; to keep them, pass the optimizer "
                                  "to deepspeed.initialize(optimizer=...), drop the \"optimizer\" key and set "
                                  "\"zero_allow_untested_optimizer\": true", runs=bits.runs))
    if set(d.activation_checkpoint) != {"none"}:
        notes.append(NotExpressed(
            "activation_checkpoint", checkpoint_summary(d), "DeepSpeed's config does not choose checkpointed blocks; "
            "nothing set: call model.gradient_checkpointing_enable() for every block fully, or "
            "trainplan.executor.apply_plan for the plan's per-block sets",
            runs={"activation_checkpoint": ("none",) * len(d.activation_checkpoint)}))
    notes.append(NotExpressed(
        "lr schedule", "warmup-stable-decay", f"DeepSpeed has no stable-then-decay schedule; used WarmupLR "
        f"(linear warmup over {s.warmup_steps} steps, one step behind trainplan's, then the peak to the end): no "
        f"cooldown over the last {s.cooldown_steps} steps"))
    notes += [NotExpressed("seq_len", str(d.seq_len), "DeepSpeed's config has no sequence length: the data "
                           "loader yields sequences of seq_len tokens"),
              NotExpressed("max_steps", str(d.max_steps), "DeepSpeed's config has no step budget: the training "
                           "loop stops after max_steps optimizer steps"),
              NotExpressed("seed", str(d.seed), "DeepSpeed's config has no seed: call "
                           "deepspeed.runtime.utils.set_random_seed(seed) in the script")]
    notes += data_and_stop(d, "DeepSpeed")
    cfg: dict[str, Any] = {
        "train_batch_size": d.micro_batch * d.grad_accum * d.dp_degree,
        "train_micro_batch_size_per_gpu": d.micro_batch,
        "gradient_accumulation_steps": d.grad_accum,
        "gradient_clipping": 0.0,
        "steps_per_print": max(1, d.max_steps // 100),
        "bf16": bf16,
        "zero_optimization": {"stage": d.zero_stage},
        "optimizer": {"type": "AdamW", "params": {
            "lr": d.lr, "betas": list(ADAMW_BETAS), "eps": ADAMW_EPS, "weight_decay": ADAMW_WEIGHT_DECAY,
            "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": d.lr, "warmup_num_steps": s.warmup_steps,
            "warmup_type": "linear"}},
    }
    if d.sp_degree > 1:
        cfg["sequence_parallel_size"] = d.sp_degree
    return cfg, notes


def export(plan: Plan) -> Export:
    """`plan` as a DeepSpeed 0.19.8 config JSON (`deepspeed.initialize(config=FILE)`, or
    `--deepspeed FILE` of HF Trainer). The plan summary and the unexpressed decisions are under
    the top-level key `trainplan` (`NOTES_KEY`), which DeepSpeed ignores."""
    cfg, notes = ds_config(plan)
    usage = ("deepspeed.initialize(model=model, model_parameters=model.parameters(), config=THIS_FILE); "
             "train_batch_size = micro x grad_accum x dp, the data-parallel world being devices / "
             "sequence_parallel_size (Ulysses attention: deepspeed.runtime.sequence_parallel)")
    cfg[NOTES_KEY] = {"plan": header(plan, "deepspeed"), "usage": f"{VERSION}: {usage}",
                      "not_expressed": not_expressed_lines(notes, "DeepSpeed")}
    return Export(target="deepspeed", kind=f"{VERSION} config JSON (unexpressed decisions under \"{NOTES_KEY}\")",
                  text=json.dumps(cfg, indent=2) + "\n", not_expressed=tuple(notes))
