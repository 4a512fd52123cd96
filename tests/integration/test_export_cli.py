"""`trainplan export` and `-q` end to end, through the command line (issue #40, items 7, 8, 9, 11):
an accelerate file for several machines read by accelerate's own launcher, the memory re-checked
after a substitution (real plans, priced by the cost models), torchtitan's placeholders, and `-q`
printing nothing but errors (`python -m trainplan` in a subprocess, as a user runs it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.support import make_plan
from trainplan.planner.cli.main import main
from trainplan.planner.plan import Plan

ROOT = Path(__file__).resolve().parents[2]


def fake_plan(**decisions) -> Plan:
    """`tests.support.make_plan` as llama3.1-8b (4 blocks) with `decisions` replaced, dp_degree and
    tokens_per_step made to agree: predictions not made by the cost models, for exports that
    substitute nothing (nothing is re-priced)."""
    p = make_plan()
    d = dataclasses.replace(p.decisions, **{"activation_checkpoint": ("full",) * 4, **decisions})
    d = dataclasses.replace(d, dp_degree=d.devices // d.sp_degree)
    tps = d.micro_batch * d.seq_len * d.dp_degree * d.grad_accum
    return dataclasses.replace(p, model="llama3.1-8b", vocab_size=128256, model_n_layers=4, decisions=d,
                               predictions=dataclasses.replace(p.predictions, tokens_per_step=tps))


def _export(tmp_path: Path, plan: Plan, to: str, *extra: str) -> tuple[int, Path]:
    plan.to_json(tmp_path / "plan.json")
    out = tmp_path / f"{to}.out"
    return main(["export", str(tmp_path / "plan.json"), "--to", to, "--out", str(out), *extra]), out


# ---------------------------------------------------------------- item 7: accelerate on several machines


def _launch(path: Path, **fill):
    """accelerate's own launcher on the file: its parser and checks (`accelerate/commands/launch.py`)
    and the torchrun arguments it derives (`accelerate/utils/launch.py` `prepare_multi_gpu_env`),
    with the placeholders replaced by `fill` (key -> value) first."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    text = path.read_text()
    for key, value in fill.items():
        text = text.replace(f"{key}: FILL_IN_{key}", f"{key}: {value}")
    filled = path.with_suffix(".filled.yaml")
    filled.write_text(text)
    args = launch_command_parser().parse_args(["--config_file", str(filled), "train.py"])
    _validate_launch_command(args)
    prepare_multi_gpu_env(args)
    return args


@pytest.mark.parametrize("devices,machines,per_machine", [(64, 8, 8), (16, 2, 8), (12, 2, 6), (9, 3, 3), (8, 1, 8)])
def test_accelerate_writes_machines_and_processes_per_machine(tmp_path, capsys, devices, machines, per_machine):
    """h200 nodes hold 8 devices: 64 devices are 8 machines of 8 processes. accelerate's
    `num_processes` is the total over the machines (its launcher starts num_processes //
    num_machines per machine); the address and each machine's rank are marked placeholders."""
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import load_config_from_file

    rc, out = _export(tmp_path, fake_plan(devices=devices, zero_stage=3), "accelerate")
    assert rc == 0
    cluster = load_config_from_file(str(out))
    assert (cluster.num_machines, cluster.num_processes) == (machines, devices)
    text = out.read_text()
    if machines == 1:
        assert "FILL_IN" not in text and cluster.machine_rank == 0
        return
    assert cluster.machine_rank == "FILL_IN_machine_rank" and cluster.main_process_ip == "FILL_IN_main_process_ip"
    lines = text.splitlines()
    for key in ("machine_rank", "main_process_ip", "main_process_port"):
        above = lines[next(i for i, line in enumerate(lines) if line.startswith(f"{key}:")) - 1]
        assert above.startswith("# FILL IN: "), (key, above)
    assert f"# {machines} machines x {per_machine} processes" in text
    with pytest.raises(ValueError, match="FILL_IN_machine_rank"):  # left unfilled: fails naming itself
        _launch(out)
    args = _launch(out, machine_rank=machines - 1, main_process_ip="10.0.0.1")
    assert (args.nproc_per_node, args.nnodes, args.node_rank) == (str(per_machine), str(machines), machines - 1)
    assert args.rdzv_endpoint == "10.0.0.1:29500"  # the rendezvous torchrun gets on every machine
    assert ("devices = " in capsys.readouterr().out) == (devices % 8 != 0)  # an uneven split is listed


def test_accelerate_deepspeed_on_several_machines_launches_torchrun_per_machine(tmp_path):
    """ZeRO-1 runs through DeepSpeed: on several machines with the `standard` multi-node launcher
    (torchrun on each machine, the same rank and address placeholders), not pdsh's hostfile."""
    pytest.importorskip("accelerate")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    rc, out = _export(tmp_path, fake_plan(devices=16, zero_stage=1), "accelerate")
    assert rc == 0
    filled = tmp_path / "filled.yaml"
    filled.write_text(out.read_text().replace("FILL_IN_machine_rank", "1").replace("FILL_IN_main_process_ip",
                                                                                   "10.0.0.1"))
    args = launch_command_parser().parse_args(["--config_file", str(filled), "train.py"])
    _validate_launch_command(args)
    args.deepspeed_fields_from_accelerate_config = ""  # set by launch_command before it calls the launcher
    cmd, _ = prepare_deepspeed_cmd_env(args)
    assert cmd is None and (args.nproc_per_node, args.nnodes, args.node_rank) == ("8", "2", 1)


def test_a_profile_files_plan_exports_with_its_file(tmp_path, capsys):
    """A plan solved with `--hw FILE.toml` names the file's profile, which `load` does not know by
    name: the export says to give it the file (`--hw FILE.toml`), reads its devices per node from
    it, and refuses a file of another profile."""
    from trainplan.hardware_profiles import load
    from trainplan.hardware_profiles.profile_file import profile_toml

    (tmp_path / "cal.toml").write_text(profile_toml(dataclasses.replace(load("h100"), name="h100-cal",
                                                                        devices_per_node=4)))
    base = fake_plan(devices=16, zero_stage=3)  # as `solve --hw cal.toml` writes it: the file recorded
    plan = dataclasses.replace(base, hw="h100-cal", options={**(base.options or {}), "hw_profile_file": "cal.toml"})
    rc, _ = _export(tmp_path, plan, "accelerate")
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "unknown hardware 'h100-cal'" in err and "give export the same --hw FILE.toml" in err, err
    rc, out = _export(tmp_path, plan, "accelerate", "--hw", str(tmp_path / "cal.toml"))
    assert rc == 0 and "num_machines: 4\nnum_processes: 16\n" in out.read_text()
    rc, _ = _export(tmp_path, plan, "accelerate", "--hw", "h100")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--hw 'h100' is profile 'h100' but the plan was made for 'h100-cal'" in err[0]


# ---------------------------------------------------------------- item 8: memory re-checked


@pytest.fixture(scope="module")
def tight_plan() -> Plan:
    """llama3.1-8b on 2 x h100, ZeRO-3, micro-batch 8, every block checkpointed, 8-bit Adam: it
    fits (about 55 of 77 GiB); with fp32 AdamW states it does not (about 77.4 GiB)."""
    from trainplan.planner.api import plan_for_choice

    return plan_for_choice("llama3.1-8b", "h100", seq_len=4096, micro_batch=8, devices=2, zero_stage=3,
                           precision="bf16-mixed", optimizer_bits=8, activation_checkpoint="full")


def test_a_substitution_that_no_longer_fits_is_refused_with_both_numbers(tmp_path, capsys, tight_plan):
    from trainplan.planner.export.repricing import GIB

    planned = tight_plan.predictions.memory_bytes["total"]
    assert planned <= tight_plan.predictions.memory_limit_bytes
    for to, runs in (("torchtitan", "optimizer_bits=32:"), ("deepspeed", "optimizer_bits=32, activation_checkpoint="
                                                                         "none x 32:")):
        rc, out = _export(tmp_path, tight_plan, to)
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and not out.exists(), (rc, err)
        assert err[0].startswith(f"trainplan: error: {to} runs {runs} ") and "--force" in err[0], err
        assert f"(the plan: {planned / GIB:.2f} GiB), does not fit in the 77.00 GiB usable" in err[0], err
    rc, out = _export(tmp_path, tight_plan, "torchtitan", "--force")  # written anyway, saying so
    stdout = capsys.readouterr().out
    assert rc == 0 and out.exists() and "memory re-checked: torchtitan runs optimizer_bits=32: 77.3" in stdout
    assert "does not fit in the 77.00 GiB usable (written: --force)" in stdout, stdout
    rc, _ = _export(tmp_path, tight_plan, "accelerate")  # accelerate names bitsandbytes' AdamW8bit: nothing re-priced
    assert rc == 0 and "memory re-checked" not in capsys.readouterr().out


def test_repricing_agrees_with_the_plan_and_reports_a_fit(tight_plan):
    """Re-priced with the plan's own decisions, the memory is the plan's; a substitution that
    fits says so with both numbers."""
    from trainplan.planner.export.common import Export, NotExpressed
    from trainplan.planner.export.repricing import reprice

    same = Export("deepspeed", "", "", (NotExpressed("optimizer_bits", "8", "", runs={"optimizer_bits": 8}),))
    r = reprice(tight_plan, same)
    assert r is not None and r.runs_bytes == pytest.approx(tight_plan.predictions.memory_bytes["total"], rel=1e-9)
    small = dataclasses.replace(tight_plan.decisions, micro_batch=1)
    from trainplan.planner.api import plan_for_choice

    fits = plan_for_choice("llama3.1-8b", "h100", seq_len=4096, micro_batch=small.micro_batch, devices=2,
                           zero_stage=3, precision="bf16-mixed", optimizer_bits=8, activation_checkpoint="full")
    r = reprice(fits, Export("torchtitan", "", "", (NotExpressed("optimizer_bits", "8", "",
                                                                 runs={"optimizer_bits": 32}),)))
    assert r is not None and r.fits and r.runs_bytes > r.planned_bytes
    assert r.line().endswith("fits in the 77.00 GiB usable"), r.line()


def test_every_target_runs_what_it_lists():
    """What each export runs instead of the plan (`Export.runs`, what the memory is re-checked
    with): the long-context knobs and compressed activations no target expresses, and the
    optimizer states torch's AdamW keeps in the parameters' dtype."""
    from trainplan.planner.export.targets import export_plan

    long = fake_plan(devices=2, zero_stage=2, loss_chunks=2, mlp_chunks=2, offload=True, activation_bits=16,
                     activation_checkpoint=("full",) * 4)
    common = {"activation_bits": 32, "loss_chunks": 1, "mlp_chunks": 1, "offload": False}
    for to in ("torchtitan", "deepspeed", "accelerate"):
        e = export_plan(long, to)
        ds = {"activation_checkpoint": ("none",) * 4} if to == "deepspeed" else {}  # DeepSpeed's config: none
        assert e.runs == common | ds, (to, e.runs)
        assert {"loss_chunks", "mlp_chunks", "offload", "activation_bits"} <= {n.decision for n in e.not_expressed}
    pure = fake_plan(devices=2, zero_stage=0, precision="bf16", optimizer_bits=8, activation_checkpoint=("none",) * 4)
    assert export_plan(pure, "torchtitan").runs == {"optimizer_bits": 16}  # bf16 parameters: bf16 AdamW states
    assert export_plan(pure, "deepspeed").runs == {"precision": "bf16-mixed", "optimizer_bits": 32}  # fp32 master
    mixed = fake_plan(devices=2, zero_stage=1, activation_checkpoint=("full", "none", "full", "save_attention"))
    assert export_plan(mixed, "torchtitan").runs == {"zero_stage": 2, "activation_checkpoint": ("full",) * 4}
    assert export_plan(mixed, "deepspeed").runs == {"activation_checkpoint": ("none",) * 4}
    assert export_plan(mixed, "accelerate").runs == {"activation_checkpoint": ("full",) * 4}


def test_an_edited_plan_that_cannot_be_repriced_is_refused(tmp_path, capsys):
    """A plan whose layer count is not its model's cannot be priced again: one line, exit 2."""
    rc, _ = _export(tmp_path, fake_plan(devices=2, zero_stage=2, optimizer_bits=8), "deepspeed")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "cannot re-check the memory of the deepspeed export" in err[0], err
    assert "activation_checkpoint has 4 entries; llama3.1-8b has 32 layers" in err[0], err


# ---------------------------------------------------------------- item 9: torchtitan's placeholders


def test_torchtitan_names_the_tokenizer_and_dataset_to_fill_in(tmp_path):
    rc, out = _export(tmp_path, fake_plan(devices=8, zero_stage=3), "torchtitan")
    assert rc == 0
    cfg = tomllib.loads(out.read_text())
    assert cfg["model"]["hf_assets_path"] == "FILL_IN_tokenizer_folder"
    assert (cfg["training"]["dataset"], cfg["training"]["dataset_path"]) == ("FILL_IN_dataset_name",
                                                                           "FILL_IN_dataset_folder")
    lines = out.read_text().splitlines()
    for key, needle in (("hf_assets_path", "tokenizer files"), ("dataset", "registered in"),
                        ("dataset_path", "local folder")):
        above = lines[next(i for i, line in enumerate(lines) if line.startswith(f"{key} =")) - 1]
        assert above.startswith("# FILL IN: ") and needle in above, (key, above)
    try:
        from torchtitan.hf_datasets.text_datasets import _validate_dataset
    except ImportError:  # torchtitan's package imports triton, absent on CPU
        return
    with pytest.raises(ValueError, match="FILL_IN_dataset_name"):  # left unfilled: torchtitan names it
        _validate_dataset(cfg["training"]["dataset"], cfg["training"]["dataset_path"])


# ---------------------------------------------------------------- item 11: -q


def _cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "trainplan", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_quiet_export_and_solve_print_nothing_but_errors(tmp_path):
    plan = fake_plan(devices=2, zero_stage=2, data_fraction=0.5)  # accelerate cannot express a data subset
    plan.to_json(tmp_path / "plan.json")
    loud = _cli("export", "plan.json", "--to", "accelerate", cwd=tmp_path)
    assert loud.returncode == 0 and "cannot express 1 decision" in loud.stderr, loud.stderr
    quiet = _cli("export", "plan.json", "--to", "accelerate", "-q", cwd=tmp_path)
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout == loud.stdout  # the file alone
    quiet = _cli("export", "plan.json", "--to", "accelerate", "--out", "a.yaml", "-q", cwd=tmp_path)
    assert quiet.returncode == 0 and quiet.stderr == quiet.stdout == "" and (tmp_path / "a.yaml").exists()
    bad = _cli("export", "missing.json", "--to", "accelerate", "-q", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.startswith("trainplan: error: cannot read plan 'missing.json'")
    solve = ["solve", "--model", "tiny-llama", "--hw", "h100", "--seq-len", "512", "--budget-device-hours", "0.01"]
    quiet = _cli(*solve, "--json", "-", "-q", cwd=tmp_path)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    assert json.loads(quiet.stdout)["model"] == "tiny-llama"  # the plan JSON alone on stdout
    quiet = _cli(*solve, "--json", "p.json", "-q", cwd=tmp_path)
    assert quiet.returncode == 0 and quiet.stderr == quiet.stdout == "" and Plan.from_json(tmp_path / "p.json")
