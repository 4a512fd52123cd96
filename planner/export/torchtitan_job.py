"""A plan as a torchtitan job TOML (`--job.config_file`): model flavor, FSDP2/HSDP degrees, context
parallelism, batch, precision, AdamW and its warmup-stable-decay schedule, activation
checkpointing.

Keys and meanings are torchtitan 0.2.2's (`torchtitan/config/job_config.py`, `JobConfig` and its
sections; `torchtitan/components/lr_scheduler.py` `build_lr_schedulers`;
`torchtitan/distributed/activation_checkpoint.py` `_apply_layer_sac`;
`torchtitan/models/llama3/__init__.py` `llama3_args`; `torchtitan/components/optimizer.py`
`build_optimizers`), the last release that reads a job TOML: torchtitan 0.3.0 replaced it with
Python `config_registry` functions (`torchtitan/config/manager.py`, `--module`/`--config`).

What torchtitan cannot express, and what the file uses instead:

- Ulysses sequence parallelism: torchtitan has context parallelism only (ring attention over the
  same sequence shards), `parallelism.context_parallel_degree = sp_degree`.
- ZeRO-1 (optimizer states alone sharded): FSDP2 without resharding after forward, i.e. ZeRO-2
  (`fsdp_reshard_after_forward = "never"`): gradients sharded too, less memory.
- Per-block checkpoint sets: one `activation_checkpoint.mode` for every block, or every n-th block
  fully checkpointed (`selective_ac_option = "n"`), or torchtitan's own per-op policy (`"op"`:
  matmul and attention outputs kept, every other matmul recomputed) for selective sets.
- 8- and 4-bit Adam: torchtitan builds torch.optim's Adam and AdamW only.
- the 5% floor of the cooldown: torchtitan decays linearly to `min_lr_factor` = 0 over the same
  steps, so the two schedules agree except in the cooldown's last 5%.
"""

from __future__ import annotations

import json
import math
from typing import Any

from trainplan.errors import TrainplanError
from trainplan.planner.export.common import (
    ADAMW_BETAS,
    ADAMW_EPS,
    ADAMW_WEIGHT_DECAY,
    COOLDOWN_FLOOR,
    Export,
    NotExpressed,
    checkpoint_summary,
    data_and_stop,
    every_nth_full,
    header,
    not_expressed_lines,
    optimizer_bits_note,
    schedule,
)
from trainplan.planner.plan import Decisions, Plan

VERSION = "torchtitan 0.2.2"
"""The torchtitan release whose job TOML this writes."""
FLAVORS: dict[str, tuple[str, str]] = {
    "llama3-8b": ("llama3", "8B"), "llama3.1-8b": ("llama3", "8B"),
    "llama3-70b": ("llama3", "70B"), "llama3.1-70b": ("llama3", "70B"),
    "llama3.1-405b": ("llama3", "405B"),
}
"""trainplan preset -> torchtitan (`model.name`, `model.flavor`): `llama3_args` in
`torchtitan/models/llama3/__init__.py` (dim, layers, heads, kv heads, FFN size and rope theta
equal to the presets'). torchtitan has no flavor of tiny-llama's size (its `debugmodel` is
another model) and no Qwen2 model (its `qwen3` has QK-norm and no QKV bias)."""
VOCAB_SIZE = 128256
"""The vocabulary of torchtitan's llama3 flavors (`TransformerModelArgs.vocab_size`)."""
LLAMA31_ROPE = ("llama3-8b", "llama3-70b")
"""Presets whose RoPE has no Llama 3.1 scaling, which torchtitan's llama3 always applies
(`RoPEScalingArgs`, factor 8)."""


def flavor(plan: Plan) -> tuple[str, str]:
    """torchtitan's (`model.name`, `model.flavor`) for `plan`'s model.

    Raises:
        TrainplanError: torchtitan has no model for it; names the model and the presets that
            have one, and the targets that take any HF model."""
    if plan.model in FLAVORS:
        return FLAVORS[plan.model]
    valid = ", ".join(f"{k} ({'/'.join(v)})" for k, v in FLAVORS.items())
    why = " (Qwen2; torchtitan's qwen3 model has QK-norm and no QKV bias)" if plan.model.startswith("qwen2") else ""
    raise TrainplanError(f"{VERSION} has no model for {plan.model!r}{why}: its job TOML names one of its own "
                         f"model flavors, which exist for {valid}; export this plan with --to deepspeed or "
                         "--to accelerate, which train any HF model")


def _parallelism(d: Decisions) -> tuple[dict[str, Any], list[NotExpressed]]:
    notes = []
    replicate, shard, reshard = 1, 1, "default"
    if d.devices > 1:
        if d.zero_stage == 0:
            replicate = d.dp_degree
        else:
            shard, reshard = d.dp_degree, "always" if d.zero_stage == 3 else "never"
    if d.zero_stage == 1 and d.devices > 1:
        notes.append(NotExpressed("zero_stage", "1", "torchtitan has no optimizer-state-only sharding; used FSDP2 "
                                  "with fsdp_reshard_after_forward = \"never\" (ZeRO-2: gradients sharded too, "
                                  "less memory, reduce-scatter instead of all-reduce)", runs={"zero_stage": 2}))
    if d.sp_degree > 1:
        notes.append(NotExpressed("sp_degree", f"{d.sp_degree} (Ulysses)", "torchtitan has context parallelism "
                                  f"only; used context_parallel_degree = {d.sp_degree} (ring attention over the same "
                                  "sequence shards: other communication, attention memory and step time)"))
        if d.zero_stage == 0:
            notes.append(NotExpressed("zero_stage", "0 with sp", "torchtitan shards parameters over the context-"
                                      "parallel ranks with FSDP2 (HSDP: replicated over dp, sharded over cp)"))
    return {"data_parallel_replicate_degree": replicate, "data_parallel_shard_degree": shard,
            "fsdp_reshard_after_forward": reshard, "tensor_parallel_degree": 1, "pipeline_parallel_degree": 1,
            "context_parallel_degree": d.sp_degree}, notes


def _checkpointing(d: Decisions) -> tuple[dict[str, Any], list[NotExpressed]]:
    kinds = {"none" if e == "none" else "full" if e == "full" else "op" for e in d.activation_checkpoint}
    nth = every_nth_full(d)
    planned = checkpoint_summary(d)
    if kinds == {"none"}:
        return {"mode": "none"}, []
    if nth == 1:
        return {"mode": "full"}, []
    if nth is not None:
        return {"mode": "selective", "selective_ac_option": str(nth)}, []
    if kinds == {"op"}:
        return {"mode": "selective", "selective_ac_option": "op"}, [NotExpressed(
            "activation_checkpoint", planned, "torchtitan has no per-block checkpoint sets; used its per-op policy on "
            "every block (selective_ac_option = \"op\": matmul and attention outputs saved, every other matmul "
            "recomputed), not the plan's saved ops; memory re-checked as save_matmuls, every matmul's output kept, "
            "an upper bound", runs={"activation_checkpoint": ("save_matmuls",) * len(d.activation_checkpoint)})]
    mode = "full" if "full" in kinds else "selective"
    cfg = {"mode": mode} if mode == "full" else {"mode": mode, "selective_ac_option": "op"}
    used = "mode = \"full\" on every block" if mode == "full" else "the per-op policy (\"op\") on every block"
    entry = "full" if mode == "full" else "save_matmuls"
    return cfg, [NotExpressed("activation_checkpoint", planned, "torchtitan applies one checkpoint mode to every block "
                              f"(or fully to every n-th block); used {used}: more recompute",
                              runs={"activation_checkpoint": (entry,) * len(d.activation_checkpoint)})]


def job_config(plan: Plan) -> tuple[dict[str, dict[str, Any]], list[NotExpressed]]:
    """The job TOML as {section: {key: value}} and the decisions it cannot express.

    Raises:
        TrainplanError: torchtitan has no model for the plan's (`flavor`)."""
    d = plan.decisions
    name, flav = flavor(plan)
    notes: list[NotExpressed] = []
    if plan.model in LLAMA31_ROPE:
        notes.append(NotExpressed("model", plan.model, "torchtitan's llama3 model applies Llama 3.1's RoPE "
                                  f"scaling; used flavor {flav}, the same sizes with Llama 3.1's RoPE"))
    if plan.vocab_size != VOCAB_SIZE:
        notes.append(NotExpressed("vocab_size", str(plan.vocab_size), f"torchtitan's {name} flavors have "
                                  f"{VOCAB_SIZE} tokens; used {VOCAB_SIZE}"))
    if plan.hw == "cpu":
        notes.append(NotExpressed("hw", "cpu", "torchtitan trains on CUDA/ROCm devices; the file is for one"))
    par, par_notes = _parallelism(d)
    ac, ac_notes = _checkpointing(d)
    s = schedule(d)
    bits = optimizer_bits_note(d, "torchtitan", "torch AdamW")
    notes += par_notes + ac_notes + ([bits] if bits else []) + [NotExpressed(
        "lr schedule", f"warmup-stable-decay to {COOLDOWN_FLOOR:g} x peak", "torchtitan decays linearly to "
        "min_lr_factor x peak over the same cooldown steps; used min_lr_factor = 0 (the same slope; no 5% floor in the "
        "cooldown's last 5%)")] + data_and_stop(d, "torchtitan")
    pure_bf16 = d.precision == "bf16"
    cfg: dict[str, dict[str, Any]] = {
        "job": {"dump_folder": "./outputs", "description": f"trainplan plan: {plan.model} on {d.devices} x {plan.hw}"},
        "model": {"name": name, "flavor": flav, "hf_assets_path": PLACEHOLDERS["model", "hf_assets_path"][0]},
        "optimizer": {"name": "AdamW", "lr": d.lr, "beta1": ADAMW_BETAS[0], "beta2": ADAMW_BETAS[1],
                      "eps": ADAMW_EPS, "weight_decay": ADAMW_WEIGHT_DECAY, "implementation": "fused"},
        "lr_scheduler": {"warmup_steps": s.warmup_steps, "total_steps": s.total_steps,
                         "decay_ratio": s.cooldown_steps / s.total_steps, "decay_type": "linear",
                         "min_lr_factor": 0.0},
        "training": {"dataset": PLACEHOLDERS["training", "dataset"][0],
                     "dataset_path": PLACEHOLDERS["training", "dataset_path"][0], "local_batch_size": d.micro_batch,
                     "global_batch_size": d.micro_batch * d.dp_degree * d.grad_accum,
                     "seq_len": d.seq_len, "max_norm": math.inf, "steps": d.max_steps,
                     "dtype": "bfloat16" if pure_bf16 else "float32",
                     "mixed_precision_param": "float32" if d.precision == "fp32" else "bfloat16",
                     "mixed_precision_reduce": "float32"},
        "parallelism": par,
        "activation_checkpoint": ac,
        "debug": {"seed": d.seed},
    }
    return cfg, notes


FILL_IN = "FILL_IN"
"""Marks a value the exported file cannot know: the user's tokenizer and data."""
PLACEHOLDERS: dict[tuple[str, str], tuple[str, str]] = {
    ("model", "hf_assets_path"): (
        f"{FILL_IN}_tokenizer_folder",
        "FILL IN: the folder of your model's Hugging Face tokenizer files (tokenizer.json, tokenizer_config.json; "
        "and its safetensors weights to start from them); torchtitan's scripts/download_hf_assets.py fetches "
        "a Llama 3.1 repository's. torchtitan's default, ./tests/assets/tokenizer, is a test tokenizer"),
    ("training", "dataset"): (
        f"{FILL_IN}_dataset_name",
        "FILL IN: a dataset registered in torchtitan.hf_datasets.text_datasets.DATASETS (0.2.2 ships c4, c4_test, "
        "c4_validation; register a DatasetConfig there for your own data). torchtitan's default, c4_test, is "
        "a test slice"),
    ("training", "dataset_path"): (
        f"{FILL_IN}_dataset_folder",
        "FILL IN: the local folder (or Hugging Face path) of that dataset, passed to its loader; delete the "
        "line to load the dataset's registered path"),
}
"""The job TOML's values the plan cannot know: (section, key) -> (the value written, the comment
above it). torchtitan 0.2.2 reads `model.hf_assets_path` for the tokenizer
(`torchtitan/components/tokenizer.py` `build_hf_tokenizer`) and `training.dataset`,
`training.dataset_path` for the data (`torchtitan/hf_datasets/text_datasets.py` `_validate_dataset`:
a name outside `DATASETS` is refused, naming itself), so a placeholder left unfilled fails at
start-up, naming itself, instead of training on torchtitan's test defaults."""
COMMENTS = {
    "model": "the model flavor matches the plan's preset; hf_assets_path is yours to fill in",
    "lr_scheduler": "warmup-stable-decay as trainplan runs it (trainplan.executor.apply.applied.lr_at): linear warmup, "
                    "peak, linear cooldown over the last decay_ratio of the steps",
    "training": "global_batch_size = local_batch_size x dp x grad_accum; max_norm = inf: trainplan does "
                "not clip gradients; dataset and dataset_path are yours to fill in",
    "parallelism": "ZeRO stage 0: DDP (replicate); 1-2: FSDP2 without resharding after forward; 3: FSDP2 "
                   "resharding",
}


def _toml_value(v: Any) -> str:
    """One TOML value: a bool, int, float (`inf`), string (a JSON string is a valid TOML basic
    string) or list of them."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "inf" if math.isinf(v) else repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))


def export(plan: Plan) -> Export:
    """`plan` as a torchtitan 0.2.2 job TOML: `torchrun ... -m torchtitan.train
    --job.config_file FILE`. The unexpressed decisions are listed as `#` comments at the top.

    Raises:
        TrainplanError: torchtitan has no model for the plan's (`flavor`)."""
    cfg, notes = job_config(plan)
    lines = [f"# {line}" for line in header(plan, "torchtitan")]
    lines.append(f"# {VERSION} job config (torchtitan/config/job_config.py): "
                 "torchrun --nproc_per_node N -m torchtitan.train --job.config_file THIS_FILE")
    lines += [f"# {line}" for line in not_expressed_lines(notes, "torchtitan")]
    lines.append(f"# to fill in before it runs: every value marked {FILL_IN} (the tokenizer folder, the dataset "
                 "and its folder)")
    for section, keys in cfg.items():
        lines.append("")
        if section in COMMENTS:
            lines.append(f"# {COMMENTS[section]}")
        lines.append(f"[{section}]")
        for k, v in keys.items():
            if (section, k) in PLACEHOLDERS:
                lines.append(f"# {PLACEHOLDERS[section, k][1]}")
            lines.append(f"{k} = {_toml_value(v)}")
    return Export(target="torchtitan", kind=f"{VERSION} job TOML (--job.config_file)",
                  text="\n".join(lines) + "\n", not_expressed=tuple(notes))
