"""A plan as an accelerate config YAML (`accelerate launch --config_file`) plus the Python settings
it cannot hold: `Accelerator`, `FullyShardedDataParallelPlugin` and `ParallelismConfig`
arguments, the optimizer and the schedule.

Keys and meanings are accelerate 1.15.0's: the YAML is `ClusterConfig`
(`src/accelerate/commands/config/config_args.py`: `distributed_type`, `mixed_precision`,
`num_processes`, `use_cpu`, `fsdp_config`, `deepspeed_config`, `parallelism_config`), whose
nested keys are `accelerate launch`'s flags (`src/accelerate/commands/launch.py`:
`--fsdp_version`, `--fsdp_reshard_after_forward`, `--fsdp_auto_wrap_policy`,
`--fsdp_activation_checkpointing`, `--zero_stage`, `--gradient_accumulation_steps`,
`--parallelism_config_dp_shard_size`, `--parallelism_config_sp_size`, ...); the Python settings
are `FullyShardedDataParallelPlugin` (`src/accelerate/utils/dataclasses.py`: `fsdp_version`,
`reshard_after_forward`, `auto_wrap_policy`, `activation_checkpointing`,
`mixed_precision_policy`), `ParallelismConfig` (`src/accelerate/parallelism_config.py`:
`dp_shard_size`, `sp_size`, `sp_backend`), `DeepSpeedSequenceParallelConfig`
(`sp_seq_length`, `sp_seq_length_is_variable`, `sp_attn_implementation`) and `Accelerator`'s
`gradient_accumulation_steps`.

The plan's ZeRO stage and SP degree pick the backend: ZeRO 2/3 without SP is FSDP2 (as the
executor runs it); ZeRO 1, or any SP degree above 1, is DeepSpeed, since accelerate runs
optimizer-state-only sharding and Ulysses SP (`ParallelismConfig(sp_backend="deepspeed")`,
ALST) only through DeepSpeed; ZeRO 0 is DDP (`MULTI_GPU`, `MULTI_CPU` on the cpu) or one process.

A plan on more devices than one node of its profile holds (`devices_per_node`) runs on several
machines: `num_machines` machines of num_processes / num_machines processes (`num_processes` is
the total, as accelerate's launcher reads it), with the rendezvous address and each machine's
rank left as marked placeholders (`PLACEHOLDERS`) and DeepSpeed started by its `standard`
(torchrun) multi-node launcher.

What accelerate cannot express, and what the file uses instead: per-block checkpoint sets
(accelerate and HF checkpoint every transformer block or none: every block, when the plan
checkpoints any), pure bf16 under DeepSpeed (its `deepspeed_config` has no
`bf16_master_weights_and_grads`: fp32 master weights).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from trainplan.costmodels.step.comm import nodes_for
from trainplan.errors import UnknownNameError
from trainplan.hardware_profiles import load
from trainplan.planner.export.common import (
    ADAMW_BETAS,
    ADAMW_WEIGHT_DECAY,
    COOLDOWN_FLOOR,
    Export,
    NotExpressed,
    checkpoint_summary,
    data_and_stop,
    header,
    not_expressed_lines,
    schedule,
)
from trainplan.planner.plan import Decisions, Plan

VERSION = "accelerate 1.15.0"
"""The accelerate release whose config keys this writes."""
FILL_IN = "FILL_IN"
"""Marks a value the exported file cannot know: each machine's own, or the cluster's address."""
PLACEHOLDERS = {
    "machine_rank": (f"{FILL_IN}_machine_rank", "FILL IN: this machine's rank, 0 on the machine at main_process_ip, "
                     "1..{last} on the others (one copy of this file per machine)"),
    "main_process_ip": (f"{FILL_IN}_main_process_ip", "FILL IN: the IP address of the machine of rank 0, "
                        "reachable from every machine"),
    "main_process_port": (29500, "FILL IN: a free TCP port on the machine of rank 0 (29500, torchrun's "
                          "default, is a placeholder)"),
}
"""The multi-machine keys of `ClusterConfig` the file leaves to fill in: key -> (the value written,
the comment above it). accelerate's launcher reads `int(machine_rank)` and passes
`main_process_ip:main_process_port` to torchrun as the rendezvous (`accelerate/utils/launch.py`
`prepare_multi_gpu_env`, `prepare_deepspeed_cmd_env`), so a string placeholder left unfilled
fails at launch, naming itself."""


@dataclass(frozen=True)
class AccelerateSettings:
    """What an accelerate run of a plan needs: the YAML (`cluster`) and the Python arguments it
    cannot hold, as plain values (dtypes by torch name, e.g. `"bfloat16"`)."""

    cluster: dict[str, Any]
    """The config YAML's keys (`ClusterConfig`)."""
    accelerator: dict[str, Any]
    """`Accelerator(...)` keyword arguments besides the plugins."""
    fsdp_plugin: dict[str, Any] | None
    """`FullyShardedDataParallelPlugin(...)` keyword arguments (FSDP2 plans), else None;
    `mixed_precision_policy` maps to dtype names."""
    parallelism: dict[str, Any] | None
    """`ParallelismConfig(...)` keyword arguments, else None; `sp_handler` holds the keyword
    arguments of `DeepSpeedSequenceParallelConfig`."""
    optimizer: str
    """The optimizer the script builds, as a Python expression over `model`."""
    notes: list[NotExpressed] = field(default_factory=list)


def _backend(d: Decisions, cpu: bool) -> str:
    if d.devices == 1:
        return "NO"
    if d.zero_stage == 1 or d.sp_degree > 1:
        return "DEEPSPEED"
    if d.zero_stage >= 2:
        return "FSDP"
    return "MULTI_CPU" if cpu else "MULTI_GPU"


def machines(plan: Plan) -> tuple[int, int]:
    """(machines, processes per machine) of `plan`: the nodes its profile's `devices_per_node`
    fill (`trainplan.costmodels.step.comm.nodes_for`: ceil(devices / devices_per_node)), raised to
    the next count that divides `devices`, since accelerate starts num_processes // num_machines
    processes on every machine (`accelerate/utils/launch.py`). A cpu plan runs on this machine:
    (1, devices).

    Raises:
        UnknownNameError: the plan's `hw` is not a known profile (`trainplan.hardware_profiles.load`);
            the message says to give a profile file's plan its file (`export --hw FILE.toml`)."""
    d = plan.decisions
    if plan.hw == "cpu" or d.devices == 1:
        return 1, d.devices
    n = nodes_for(d.devices, devices_per_node(plan))
    while d.devices % n:
        n += 1
    return n, d.devices // n


def devices_per_node(plan: Plan) -> int:
    """The devices one node of `plan`'s profile holds.

    Raises:
        UnknownNameError: the plan's `hw` is not a known profile; names `export --hw FILE.toml`."""
    try:
        return load(plan.hw).devices_per_node
    except UnknownNameError as e:
        raise UnknownNameError(f"{e}; for a plan solved with --hw FILE.toml, give export the same --hw "
                               "FILE.toml") from None


def _with_placeholder_comments(body: str, n_machines: int) -> str:
    """The YAML `body` with a `# FILL IN: ...` comment line above each top-level key of
    `PLACEHOLDERS` (multi-machine files only)."""
    if n_machines == 1:
        return body
    out = []
    for line in body.splitlines():
        key = line.split(":", 1)[0]
        if key in PLACEHOLDERS:
            out.append(f"# {PLACEHOLDERS[key][1].format(last=n_machines - 1)}")
        out.append(line)
    return "\n".join(out) + "\n"


def _optimizer(d: Decisions) -> str:
    args = f"lr={d.lr!r}, betas={ADAMW_BETAS!r}, weight_decay={ADAMW_WEIGHT_DECAY!r}"
    if d.optimizer_bits == 8:
        return f"bitsandbytes.optim.AdamW8bit(model.parameters(), {args})"
    if d.optimizer_bits == 4:
        return f"torchao.optim.AdamW4bit(model.parameters(), {args})"
    return f"torch.optim.AdamW(model.parameters(), {args})"


def settings(plan: Plan) -> AccelerateSettings:
    """The accelerate settings of `plan` and the decisions accelerate cannot express."""
    d = plan.decisions
    backend = _backend(d, plan.hw == "cpu")
    checkpointed = set(d.activation_checkpoint) != {"none"}
    notes: list[NotExpressed] = []
    if checkpointed and set(d.activation_checkpoint) != {"full"}:
        notes.append(NotExpressed("activation_checkpoint", checkpoint_summary(d),
                                  "accelerate checkpoints every transformer "
                                  "block or none; used every block fully checkpointed: more recompute",
                                  runs={"activation_checkpoint": ("full",) * len(d.activation_checkpoint)}))
    mixed = "bf16" if d.precision == "bf16-mixed" or (d.precision == "bf16" and backend == "DEEPSPEED") else "no"
    if d.precision == "bf16" and backend == "DEEPSPEED":
        notes.append(NotExpressed("precision", "bf16 (pure)", "accelerate's deepspeed_config has no "
                                  "bf16_master_weights_and_grads; used mixed_precision bf16 (fp32 master weights, "
                                  "more memory), or set deepspeed_config_file to `trainplan export --to deepspeed`'s",
                                  runs={"precision": "bf16-mixed"} | ({"optimizer_bits": 32} if d.optimizer_bits == 16
                                                                      else {})))
    n_machines, per_machine = machines(plan)
    if n_machines > 1 and d.devices % devices_per_node(plan):
        notes.append(NotExpressed("devices", f"{d.devices} on {devices_per_node(plan)}-device nodes",
                                  "accelerate starts the same number of processes on every machine; used "
                                  f"{n_machines} machines x {per_machine} processes (the plan's communication "
                                  "was priced with full nodes first)"))
    cluster: dict[str, Any] = {  # num_processes: the total over all machines (accelerate launch --num_processes)
        "compute_environment": "LOCAL_MACHINE", "debug": False, "distributed_type": backend,
        "mixed_precision": mixed, "num_machines": n_machines, "num_processes": d.devices, "machine_rank": 0,
        "main_training_function": "main", "rdzv_backend": "static", "same_network": True,
        "use_cpu": plan.hw == "cpu", "enable_cpu_affinity": False,
    }
    if n_machines > 1:
        cluster.update({k: v for k, (v, _) in PLACEHOLDERS.items()})
    fsdp: dict[str, Any] | None = None
    parallelism: dict[str, Any] | None = None
    if backend == "FSDP":
        cluster["fsdp_config"] = {
            "fsdp_version": 2, "fsdp_reshard_after_forward": d.zero_stage == 3,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_activation_checkpointing": checkpointed,
            "fsdp_offload_params": False, "fsdp_state_dict_type": "SHARDED_STATE_DICT"}
        cluster["parallelism_config"] = {"parallelism_config_dp_replicate_size": 1,
                                         "parallelism_config_dp_shard_size": d.devices}
        fsdp = {"fsdp_version": 2, "reshard_after_forward": d.zero_stage == 3,
                "auto_wrap_policy": "transformer_based_wrap", "activation_checkpointing": checkpointed,
                "state_dict_type": "SHARDED_STATE_DICT"}
        if d.precision == "bf16-mixed":
            fsdp["mixed_precision_policy"] = {"param_dtype": "bfloat16", "reduce_dtype": "float32",
                                              "output_dtype": "bfloat16"}
        parallelism = {"dp_replicate_size": 1, "dp_shard_size": d.devices}
    if backend == "DEEPSPEED":
        cluster["deepspeed_config"] = {"zero_stage": d.zero_stage, "gradient_accumulation_steps": d.grad_accum,
                                       "gradient_clipping": 0.0, "offload_optimizer_device": "none",
                                       "offload_param_device": "none", "zero3_init_flag": False}
        if n_machines > 1:  # torchrun on each machine, as for FSDP: the same rank and address placeholders
            cluster["deepspeed_config"]["deepspeed_multinode_launcher"] = "standard"
        if d.sp_degree > 1:
            cluster["parallelism_config"] = {
                "parallelism_config_sp_size": d.sp_degree, "parallelism_config_sp_backend": "deepspeed",
                "parallelism_config_sp_seq_length": str(d.seq_len),
                "parallelism_config_sp_seq_length_is_variable": False,
                "parallelism_config_sp_attn_implementation": "sdpa"}
            parallelism = {"sp_size": d.sp_degree, "sp_backend": "deepspeed", "sp_handler": {
                "sp_seq_length": d.seq_len, "sp_seq_length_is_variable": False, "sp_attn_implementation": "sdpa"}}
    accelerator = {"gradient_accumulation_steps": d.grad_accum, "mixed_precision": mixed,
                   "step_scheduler_with_optimizer": False}
    notes += data_and_stop(d, "accelerate")
    return AccelerateSettings(cluster=cluster, accelerator=accelerator, fsdp_plugin=fsdp, parallelism=parallelism,
                              optimizer=_optimizer(d), notes=notes)


def _kwargs(values: dict[str, Any]) -> str:
    """`k=v, ...` with dtype names as `torch.<name>`."""
    def show(v: Any) -> str:
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k!r}: torch.{x}" for k, x in v.items()) + "}"
        return repr(v)
    return ", ".join(f"{k}={show(v)}" for k, v in values.items())


def python_settings(plan: Plan, s: AccelerateSettings) -> list[str]:
    """The training script's lines for what the YAML cannot hold: the plugins, the precision,
    the optimizer and the warmup-stable-decay schedule (`trainplan.executor.apply.applied.lr_at`), the checkpointing
    of a DDP or DeepSpeed run, the seed and the step budget."""
    d, sch = plan.decisions, schedule(plan.decisions)
    lines = ["import torch", "from accelerate import Accelerator",
             "from accelerate.utils import FullyShardedDataParallelPlugin, ParallelismConfig, set_seed"]
    if s.parallelism and "sp_handler" in s.parallelism:
        lines.append("from accelerate.utils import DeepSpeedSequenceParallelConfig")
    if d.optimizer_bits in (8, 4):
        lines.append("import bitsandbytes" if d.optimizer_bits == 8 else "import torchao.optim")
    lines.append(f"set_seed({d.seed})")
    kw = dict(s.accelerator)
    plugins = []
    if s.fsdp_plugin is not None:
        lines.append(f"fsdp_plugin = FullyShardedDataParallelPlugin({_kwargs(s.fsdp_plugin)})")
        plugins.append("fsdp_plugin=fsdp_plugin")
    if s.parallelism is not None:
        pc = {k: v for k, v in s.parallelism.items() if k != "sp_handler"}
        handler = s.parallelism.get("sp_handler")
        extra = f", sp_handler=DeepSpeedSequenceParallelConfig({_kwargs(handler)})" if handler else ""
        lines.append(f"parallelism_config = ParallelismConfig({_kwargs(pc)}{extra})")
        plugins.append("parallelism_config=parallelism_config")
    lines.append(f"accelerator = Accelerator({', '.join([_kwargs(kw), *plugins])})")
    if d.precision == "bf16":
        lines.append("model = model.to(torch.bfloat16)  # pure bf16: parameters, gradients, Adam states")
    if s.fsdp_plugin is None and set(d.activation_checkpoint) != {"none"}:
        lines.append("model.gradient_checkpointing_enable()  # every block (HF models)")
    lines.append(f"optimizer = {s.optimizer}")
    lines.append(f"def lr_factor(t):  # warmup-stable-decay over {sch.total_steps} steps")
    lines.append(f"    if t < {sch.warmup_steps}: return (t + 1) / {sch.warmup_steps}")
    start = sch.total_steps - sch.cooldown_steps
    lines.append(f"    return 1.0 if t < {start} else max({COOLDOWN_FLOOR}, ({sch.total_steps} - t) / "
                 f"{sch.cooldown_steps})")
    lines.append("scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)")
    lines.append("model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)")
    lines.append("# scheduler.step() once per optimizer step: when accelerator.sync_gradients")
    lines.append(f"# loader: micro_batch {d.micro_batch} x {d.seq_len} tokens per process and micro-step; "
                 f"stop after {d.max_steps} optimizer steps ({d.max_steps * d.grad_accum} micro-steps)")
    return lines


def export(plan: Plan) -> Export:
    """`plan` as an accelerate 1.15.0 config YAML; the Python settings it cannot hold (plugins,
    optimizer, schedule) and the unexpressed decisions are `#` comments at the top."""
    s = settings(plan)
    lines = [f"# {line}" for line in header(plan, "accelerate")]
    lines.append(f"# {VERSION} config (accelerate launch --config_file THIS_FILE train.py); in train.py:")
    lines += [f"#   {line}" for line in python_settings(plan, s)]
    lines += [f"# {line}" for line in not_expressed_lines(s.notes, "accelerate")]
    n_machines = s.cluster["num_machines"]
    if n_machines > 1:
        lines.append(f"# {n_machines} machines x {s.cluster['num_processes'] // n_machines} processes: run "
                     "`accelerate launch --config_file THIS_FILE train.py` on every machine, each with its own "
                     f"machine_rank; fill in the values marked {FILL_IN} below")
    body = _with_placeholder_comments(yaml.safe_dump(s.cluster, sort_keys=False, default_flow_style=False),
                                      n_machines)
    return Export(target="accelerate", kind=f"{VERSION} config YAML (+ the Python settings as comments)",
                  text="\n".join(lines) + "\n" + body, not_expressed=tuple(s.notes))
