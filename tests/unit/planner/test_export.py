"""`trainplan export` (trainplan.planner.export): each target's file loaded by the framework's own parser where
it installs on CPU (DeepSpeed's `DeepSpeedConfig`; accelerate's `load_config_from_file`, its
launcher's argument handling and its plugin classes), else checked against the keys transcribed
from the framework's source (torchtitan 0.2.2's `JobConfig`; also read by torchtitan's own
`ConfigManager` where torchtitan is installed); the unexpressed decisions in the file and on the
terminal; the CLI's `--out` and stdout. Plans are built in memory (`tests.support.make_plan`): no capture, no solve.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tests.support import make_plan
from trainplan.errors import TrainplanError
from trainplan.planner.cli.main import build_parser, main
from trainplan.planner.export import accelerate_yaml, common, deepspeed_json, torchtitan_job
from trainplan.planner.export.targets import TARGETS, export_plan
from trainplan.planner.plan import Plan

S, N, F, B = str, int, float, bool
TORCHTITAN_KEYS: dict[str, dict[str, Any]] = {
    "job": {"config_file": (S, None), "dump_folder": S, "description": S, "print_config": B,
            "save_config_file": (S, None), "custom_config_module": S},
    "model": {"name": S, "flavor": S, "hf_assets_path": S, "tokenizer_path": (S, None), "converters": list,
              "print_after_conversion": B},
    "optimizer": {"name": S, "lr": F, "beta1": F, "beta2": F, "eps": F, "weight_decay": F,
                  "implementation": {"for-loop", "foreach", "fused"}, "early_step_in_backward": B},
    "lr_scheduler": {"warmup_steps": N, "total_steps": (N, None), "decay_ratio": (F, None),
                     "decay_type": {"linear", "sqrt", "cosine"}, "min_lr_factor": F},
    "training": {"dataset": S, "dataset_path": (S, None), "local_batch_size": N, "global_batch_size": N,
                 "seq_len": N, "max_norm": (F, N), "steps": N, "enable_cpu_offload": B,
                 "dtype": {"bfloat16", "float32"}, "mixed_precision_param": {"bfloat16", "float32"},
                 "mixed_precision_reduce": {"float32"}, "gc_freq": N, "gc_debug": B},
    "parallelism": {"data_parallel_replicate_degree": N, "data_parallel_shard_degree": N,
                    "fsdp_reshard_after_forward": {"default", "always", "never"}, "tensor_parallel_degree": N,
                    "disable_loss_parallel": B, "enable_async_tensor_parallel": B, "pipeline_parallel_degree": N,
                    "context_parallel_degree": N, "context_parallel_load_balancer": (S, None),
                    "context_parallel_rotate_method": {"allgather", "alltoall"}, "expert_parallel_degree": N},
    "activation_checkpoint": {"mode": {"selective", "full", "memory_budget", "none"}, "selective_ac_option": S,
                              "early_stop": B, "memory_budget": F, "preserve_rng_state": B,
                              "determinism_check": S, "debug": B},
    "debug": {"seed": (N, None), "deterministic": B, "deterministic_warn_only": B},
}
"""torchtitan 0.2.2's job TOML keys and types, transcribed from `torchtitan/config/job_config.py`
(`JobConfig`'s sections; a set is a `Literal`'s values, a tuple a union, None a `| None`)."""
TORCHTITAN_LLAMA3 = {"8B": (4096, 32, 32, 8, 1.3, 1024), "70B": (8192, 80, 64, 8, 1.3, 4096),
                     "405B": (16384, 126, 128, 8, 1.2, 4096)}
"""`llama3_args` in torchtitan 0.2.2's `torchtitan/models/llama3/__init__.py`: dim, n_layers,
n_heads, n_kv_heads, ffn_dim_multiplier, multiple_of."""


def plan_of(model: str = "llama3.1-8b", vocab_size: int = 128256, **decisions) -> Plan:
    """A plan of `model` with `decisions` replaced (dp_degree follows devices / sp_degree) and
    `tokens_per_step` made to agree, so that it also reads back from JSON."""
    p = make_plan()
    d = dataclasses.replace(p.decisions, **decisions)
    d = dataclasses.replace(d, dp_degree=d.devices // d.sp_degree,
                            activation_checkpoint=decisions.get("activation_checkpoint", ("none",) * 4))
    tps = d.micro_batch * d.seq_len * d.dp_degree * d.grad_accum
    return dataclasses.replace(p, model=model, vocab_size=vocab_size, model_n_layers=len(d.activation_checkpoint),
                               decisions=d,
                               predictions=dataclasses.replace(p.predictions, tokens_per_step=tps))


def _check_toml_keys(cfg: dict) -> None:
    for section, keys in cfg.items():
        assert section in TORCHTITAN_KEYS, section
        for key, value in keys.items():
            spec = TORCHTITAN_KEYS[section].get(key)
            assert spec is not None, f"[{section}] {key} is not a torchtitan 0.2.2 key"
            if isinstance(spec, set):
                assert value in spec, (section, key, value)
            else:
                types = tuple(t for t in (spec if isinstance(spec, tuple) else (spec,)) if t is not None)
                assert isinstance(value, types) and not (isinstance(value, bool) and bool not in types), (key, value)


# ---------------------------------------------------------------- torchtitan


def test_torchtitan_job_toml_has_only_its_documented_keys_and_the_plans_values():
    plan = plan_of(devices=8, sp_degree=2, zero_stage=3, micro_batch=2, grad_accum=4, precision="bf16-mixed",
                   activation_checkpoint=("none", "full", "none", "full"), max_steps=1000, seed=7)
    e = export_plan(plan, "torchtitan")
    cfg = tomllib.loads(e.text)
    _check_toml_keys(cfg)
    assert cfg["model"] == {"name": "llama3", "flavor": "8B", "hf_assets_path": "FILL_IN_tokenizer_folder"}
    assert cfg["parallelism"]["data_parallel_shard_degree"] == 4 and cfg["parallelism"]["context_parallel_degree"] == 2
    assert cfg["parallelism"]["fsdp_reshard_after_forward"] == "always"
    assert cfg["training"]["local_batch_size"] == 2 and cfg["training"]["global_batch_size"] == 2 * 4 * 4
    assert cfg["training"]["mixed_precision_param"] == "bfloat16" and cfg["training"]["dtype"] == "float32"
    assert math.isinf(cfg["training"]["max_norm"]) and cfg["debug"]["seed"] == 7
    assert cfg["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "2"}  # every 2nd block
    assert [n.decision for n in e.not_expressed] == ["sp_degree", "lr schedule"]


def _torchtitan_config_manager():
    """torchtitan 0.2.2's own `ConfigManager` (`torchtitan/config/manager.py`: the job TOML read
    with tomllib into `JobConfig` by tyro, refusing unknown keys), or skip without torchtitan.
    `import torchtitan` runs its package `__init__`, which imports triton (its MoE kernels), absent
    on CPU; the config package needs only torch and tyro, so it is imported under an empty
    `torchtitan` package on torchtitan's own path."""
    import importlib.util
    import sys
    import types

    spec = importlib.util.find_spec("torchtitan")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torchtitan is not installed (pip install 'torchtitan>=0.2.2,<0.3')")
    try:
        from torchtitan.config import ConfigManager
    except ImportError:
        package = types.ModuleType("torchtitan")
        package.__path__, package.__spec__ = list(spec.submodule_search_locations), spec
        sys.modules["torchtitan"] = package
        from torchtitan.config import ConfigManager
    return ConfigManager


@pytest.mark.parametrize("decisions", [
    {"devices": 8, "sp_degree": 2, "zero_stage": 3, "activation_checkpoint": ("none", "full", "none", "full")},
    {"devices": 4, "zero_stage": 0, "precision": "bf16", "optimizer_bits": 16, "activation_checkpoint": ("full",) * 4},
    {"devices": 4, "zero_stage": 1, "optimizer_bits": 8, "activation_checkpoint": ("remat:1",) * 4,
     "checkpoint_sets": {"remat:1": ["aten.mm.default#0"]}},
])
def test_torchtitan_job_toml_loads_in_torchtitan(tmp_path, decisions):
    config_manager = _torchtitan_config_manager()
    plan = plan_of(grad_accum=2, **decisions)
    path = tmp_path / "job.toml"
    path.write_text(export_plan(plan, "torchtitan").text)
    cfg = config_manager().parse_args(["--job.config_file", str(path)])
    ours = tomllib.loads(path.read_text())
    for section, keys in ours.items():
        for key, value in keys.items():
            assert getattr(getattr(cfg, section), key) == value, (section, key)


@pytest.mark.parametrize("stage,replicate,shard,reshard", [(0, 4, 1, "default"), (1, 1, 4, "never"),
                                                           (2, 1, 4, "never"), (3, 1, 4, "always")])
def test_torchtitan_zero_stages(stage, replicate, shard, reshard):
    e = export_plan(plan_of(devices=4, zero_stage=stage), "torchtitan")
    par = tomllib.loads(e.text)["parallelism"]
    assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"],
            par["fsdp_reshard_after_forward"]) == (replicate, shard, reshard)
    assert ("zero_stage" in [n.decision for n in e.not_expressed]) == (stage == 1)


def _torchtitan_lr_factor(step: int, warmup: int, total: int, decay_ratio: float) -> float:
    """`linear_warmup_stable_decay` of torchtitan 0.2.2's `torchtitan/components/lr_scheduler.py`
    (`build_lr_schedulers`: decay_steps = round(total x decay_ratio), a virtual last step), with
    decay_type linear and min_lr_factor 0."""
    decay = round(total * decay_ratio)
    stable = total + 1 - warmup - decay
    if step < warmup:
        return (step + 1) / warmup
    if step < warmup + stable:
        return 1.0
    return 1 - (step + 1 - (warmup + stable)) / decay


@pytest.mark.parametrize("max_steps,warmup", [(100, 20), (8, 2), (37, 3), (1000, 20)])
def test_torchtitan_schedule_is_the_executors_but_the_floor(max_steps, warmup):
    from trainplan.executor.apply.applied import lr_at

    plan = plan_of(max_steps=max_steps, warmup_steps=warmup, lr=1.0)
    sched = tomllib.loads(export_plan(plan, "torchtitan").text)["lr_scheduler"]
    for step in range(max_steps):
        ours = lr_at(step, plan)
        theirs = _torchtitan_lr_factor(step, sched["warmup_steps"], sched["total_steps"], sched["decay_ratio"])
        assert theirs == pytest.approx(ours) or (ours == common.COOLDOWN_FLOOR and theirs < ours), (step, ours, theirs)


def test_accelerate_scripts_schedule_is_the_executors():
    from trainplan.executor.apply.applied import lr_at

    plan = plan_of(max_steps=37, warmup_steps=3, lr=1.0)
    lines = accelerate_yaml.python_settings(plan, accelerate_yaml.settings(plan))
    start = next(i for i, line in enumerate(lines) if line.startswith("def lr_factor"))
    scope: dict[str, Any] = {}
    exec("\n".join(lines[start:start + 3]), scope)  # the file's own lr_factor
    assert [scope["lr_factor"](t) for t in range(37)] == pytest.approx([lr_at(t, plan) for t in range(37)])


def test_torchtitan_flavors_are_the_presets_sizes():
    from trainplan.modeling.presets import get_preset

    for preset, (name, flavor) in torchtitan_job.FLAVORS.items():
        dim, layers, heads, kv, mult, multiple = TORCHTITAN_LLAMA3[flavor]
        ffn = multiple * ((int(mult * int(2 * 4 * dim / 3)) + multiple - 1) // multiple)  # FeedForward.__init__
        p = get_preset(preset)
        assert (name, p.hidden_size, p.num_hidden_layers, p.num_attention_heads, p.num_key_value_heads,
                p.intermediate_size, p.vocab_size) == ("llama3", dim, layers, heads, kv, ffn, torchtitan_job.VOCAB_SIZE)


@pytest.mark.parametrize("model,needles", [
    ("tiny-llama", ["'tiny-llama'", "llama3.1-8b (llama3/8B)", "--to deepspeed"]),
    ("qwen2.5-7b", ["'qwen2.5-7b' (Qwen2", "QK-norm", "--to accelerate"])])
def test_torchtitan_refuses_a_model_it_has_no_flavor_for(model, needles):
    with pytest.raises(TrainplanError) as err:
        export_plan(plan_of(model=model), "torchtitan")
    assert all(n in str(err.value) for n in needles), err.value


def test_unexpressible_decisions_are_listed_in_every_file():
    plan = plan_of(devices=4, sp_degree=2, zero_stage=1, optimizer_bits=4, activation_bits=8, data_fraction=0.5,
                   data_method="dsir", governor_threshold=0.01,
                   activation_checkpoint=("full", "remat:1", "none", "none"),
                   checkpoint_sets={"remat:1": ["aten.mm.default#0"]})
    for to in TARGETS:
        e = export_plan(plan, to)
        names = {n.decision for n in e.not_expressed}
        assert {"activation_bits", "data_fraction", "governor_threshold", "activation_checkpoint"} <= names, (to, names)
        if to != "accelerate":  # accelerate's script builds torchao's AdamW4bit itself
            assert "optimizer_bits" in names, to
        text = json.loads(e.text)[deepspeed_json.NOTES_KEY]["not_expressed"] if to == "deepspeed" else e.text
        for n in e.not_expressed:
            assert f"- {n.line()}" in (text if to == "deepspeed" else e.text), (to, n)
    tt = export_plan(plan, "torchtitan")
    assert {"sp_degree", "zero_stage"} <= {n.decision for n in tt.not_expressed}
    assert tomllib.loads(tt.text)["activation_checkpoint"]["mode"] == "full"  # one mode: the most recompute


# ---------------------------------------------------------------- DeepSpeed


@pytest.fixture
def ds_config(monkeypatch):
    """DeepSpeed's own `DeepSpeedConfig` on a world of `devices` ranks without a process group."""
    pytest.importorskip("deepspeed")
    import deepspeed.runtime.config as ds

    def load(text: str, devices: int):
        monkeypatch.setattr(ds.dist, "get_rank", lambda *a, **k: 0)
        monkeypatch.setattr(ds.dist, "get_world_size", lambda *a, **k: devices)
        return ds.DeepSpeedConfig(json.loads(text))
    return load


@pytest.mark.parametrize("stage,sp,precision,bits", [(0, 1, "fp32", 32), (1, 2, "bf16-mixed", 8),
                                                     (2, 1, "bf16", 16), (3, 2, "bf16-mixed", 32)])
def test_deepspeed_config_loads_in_deepspeed(ds_config, stage, sp, precision, bits):
    plan = plan_of(devices=4, sp_degree=sp, zero_stage=stage, micro_batch=2, grad_accum=3, precision=precision,
                   optimizer_bits=bits)
    e = export_plan(plan, "deepspeed")
    cfg = ds_config(e.text, 4)  # train_batch_size = micro x accum x (devices / sequence_parallel_size), checked by it
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == \
        (2 * 3 * 4 // sp, 2, 3)
    assert cfg.zero_optimization_stage == stage and cfg.gradient_clipping == 0.0
    assert cfg.bfloat16_config.enabled == (precision != "fp32")
    assert cfg.bfloat16_config.bf16_optimizer_states == (precision == "bf16")
    assert cfg.optimizer_name == "adamw" and cfg.optimizer_params["lr"] == plan.decisions.lr
    assert cfg.scheduler_name == "WarmupLR"
    assert ("optimizer_bits" in [n.decision for n in e.not_expressed]) == (bits == 8)


# ---------------------------------------------------------------- accelerate


def _launch_args(path: Path):
    """What `accelerate launch --config_file PATH train.py` makes of the file (its own parser and
    checks, `accelerate/commands/launch.py`)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    _validate_launch_command(args)
    return args


@pytest.mark.parametrize("stage,sp,devices,backend", [(3, 1, 8, "FSDP"), (2, 1, 4, "FSDP"), (1, 1, 2, "DEEPSPEED"),
                                                      (0, 2, 4, "DEEPSPEED"), (0, 1, 2, "MULTI_GPU"), (0, 1, 1, "NO")])
def test_accelerate_yaml_loads_and_launches_in_accelerate(tmp_path, monkeypatch, stage, sp, devices, backend):
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DeepSpeedSequenceParallelConfig, FullyShardedDataParallelPlugin, ParallelismConfig
    from accelerate.utils.launch import prepare_multi_gpu_env

    plan = plan_of(devices=devices, sp_degree=sp, zero_stage=stage, grad_accum=2, activation_checkpoint=("full",) * 4)
    path = tmp_path / "accelerate.yaml"
    path.write_text(export_plan(plan, "accelerate").text)
    cluster = load_config_from_file(str(path))
    assert cluster.distributed_type.value == backend and cluster.num_processes == devices
    args = _launch_args(path)
    s = accelerate_yaml.settings(plan)
    compile("\n".join(accelerate_yaml.python_settings(plan, s)), "train.py", "exec")  # the comment's code parses
    if backend == "FSDP":
        for key, value in prepare_multi_gpu_env(args).items():  # the launcher's environment, read by the plugin
            monkeypatch.setenv(key, value)
        from_yaml = FullyShardedDataParallelPlugin()
        import torch

        kw = dict(s.fsdp_plugin or {})
        kw["mixed_precision_policy"] = {k: getattr(torch, v) for k, v in kw["mixed_precision_policy"].items()}
        ours = FullyShardedDataParallelPlugin(**kw)
        assert from_yaml.reshard_after_forward == ours.reshard_after_forward == (stage == 3)
        assert from_yaml.activation_checkpointing and ours.activation_checkpointing
        assert ours.mixed_precision_policy.reduce_dtype == torch.float32
        assert ParallelismConfig(**(s.parallelism or {})).dp_shard_size == devices == int(
            args.parallelism_config_dp_shard_size)
    if backend == "DEEPSPEED":
        assert int(args.zero_stage) == stage and int(args.gradient_accumulation_steps) == 2
        if sp > 1:
            pc = dict(s.parallelism or {})
            pc["sp_handler"] = DeepSpeedSequenceParallelConfig(**pc["sp_handler"])
            assert ParallelismConfig(**pc).sp_size == sp == int(args.parallelism_config_sp_size)


# ---------------------------------------------------------------- the command line


def test_cli_out_file_and_stdout(tmp_path, capsys):
    plan = plan_of(devices=2, zero_stage=2, optimizer_bits=8)
    plan.to_json(tmp_path / "plan.json")
    out = tmp_path / "ds_config.json"  # --force: the in-memory plan's 4 blocks are not llama3.1-8b's to re-price
    assert main(["export", str(tmp_path / "plan.json"), "--to", "deepspeed", "--out", str(out), "--force"]) == 0
    stdout = capsys.readouterr().out
    assert stdout.startswith(f"wrote {out}: DeepSpeed 0.19.8 config JSON") and "optimizer_bits = 8" in stdout
    assert json.loads(out.read_text())["zero_optimization"] == {"stage": 2}
    for to in TARGETS:
        assert main(["export", str(tmp_path / "plan.json"), "--to", to, "--force"]) == 0
        std = capsys.readouterr()
        assert std.out == export_plan(plan, to).text  # the file alone on stdout
        assert std.err.startswith(f"trainplan: {to} cannot express" if to != "accelerate"
                                  else "trainplan: accelerate expresses every decision"), std.err


def test_cli_out_must_be_a_file_in_an_existing_folder(tmp_path, capsys):
    plan_of().to_json(tmp_path / "plan.json")
    for out, needle in ((str(tmp_path), "is a folder; give a file path such as"),
                        (str(tmp_path / "no_dir" / "job.toml"), "does not exist; create the folder")):
        assert main(["export", str(tmp_path / "plan.json"), "--to", "torchtitan", "--out", out]) == 2
        line = capsys.readouterr().err.strip()
        assert line.startswith(f"trainplan: error: --out {out!r}") and needle in line, line


def test_deepspeed_pure_bf16_without_zero_keeps_fp32_master_weights(ds_config):
    e = export_plan(plan_of(devices=2, zero_stage=0, precision="bf16", optimizer_bits=16), "deepspeed")
    assert not ds_config(e.text, 2).bfloat16_config.bf16_master_weights_and_grads
    assert [n.planned for n in e.not_expressed if n.decision == "precision"] == ["bf16 (pure)"]


def test_cli_targets_and_constants_agree():
    from trainplan.executor.optimizers import BETAS, WEIGHT_DECAY

    sub = next(a for a in build_parser()._actions if getattr(a, "choices", None) and "export" in a.choices)
    to = next(a for a in sub.choices["export"]._actions if a.dest == "to")
    assert tuple(to.choices) == tuple(TARGETS)
    assert (common.ADAMW_BETAS, common.ADAMW_WEIGHT_DECAY) == (BETAS, WEIGHT_DECAY)
