"""`trainplan export` end to end, through the command line (issue #40): an accelerate file for
several machines read by accelerate's own launcher; torchtitan's placeholders.
"""

from __future__ import annotations

import dataclasses
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
