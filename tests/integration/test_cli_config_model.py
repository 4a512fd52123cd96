"""`trainplan solve --model config.json` (issue #20 item 5): a tiny Qwen2 config.json, given as a
file or as its folder, is planned on the meta device; the plan JSON holds the config and, for a
sequence beyond its max_position_embeddings, a warning that the CLI prints on one line (presets
too); `trainplan run` rebuilds the same model from the plan and trains it, `trainplan
export-weights` writes it as a Qwen2 folder; a plan whose config was edited is refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

import trainplan.planner.cli.main as cli
from trainplan.executor.record import RunRecord
from trainplan.planner.api import with_model_facts
from trainplan.planner.plan import Plan

QWEN2 = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 128,
         "tie_word_embeddings": False}
"""A tiny Qwen2 (2 layers, hidden 64): about 158K parameters; every size field given."""


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("models") / "tinyq"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN2))
    return d


def own(warnings) -> tuple[str, ...]:
    """The warnings these tests are about: not the loss law's bound near ln(V) (a tiny config at a tiny
    budget, `trainplan.costmodels.loss.bounds`), which tests/unit/costmodels/test_loss_bounds.py checks."""
    return tuple(w for w in warnings if "is a bound near ln(V)" not in w)


def _solve(tmp_path: Path, model: str, seq_len: int, budget_flops: str, capsys) -> tuple[Plan, str]:
    path = tmp_path / f"plan-{seq_len}.json"
    rc = cli.main(["solve", "--model", model, "--hw", "cpu", "--seq-len", str(seq_len), "--budget-flops",
                   budget_flops, "--json", str(path)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return Plan.from_json(path), out


def test_a_config_is_planned_and_stored_with_a_position_warning(folder, tmp_path, capsys, cpu_profile):
    plan, out = _solve(tmp_path, str(folder / "config.json"), 256, "1e12", capsys)
    raw = json.loads((tmp_path / "plan-256.json").read_text())
    assert raw["hf_config"] == QWEN2 and plan.hf_config == QWEN2
    assert plan.model == "qwen2-tinyq" and plan.model_n_layers == 2 and plan.vocab_size == 512
    assert len(own(plan.warnings)) == 1 and raw["warnings"] == list(plan.warnings)
    assert own(plan.warnings)[0].startswith("seq_len=256 is beyond qwen2-tinyq's max_position_embeddings=128")
    printed = [line for line in out.splitlines() if "warning:" in line and "bound near ln(V)" not in line]
    assert printed == [f"  warning: {own(plan.warnings)[0]}"], out
    assert "plan: qwen2-tinyq" in out


def test_a_folder_within_its_positions_has_no_warning(folder, tmp_path, capsys, cpu_profile):
    plan, out = _solve(tmp_path, str(folder), 128, "1e12", capsys)
    assert plan.hf_config == QWEN2 and own(plan.warnings) == ()
    assert not [line for line in out.splitlines() if "warning:" in line and "bound near ln(V)" not in line]


def test_a_config_leaving_fields_to_defaults_is_planned_with_a_warning(tmp_path, capsys, cpu_profile):
    """Issue #40 item 5: a Llama config without num_key_value_heads, max_position_embeddings and
    tie_word_embeddings is planned, and the plan (JSON and the printed summary) names each with the
    value transformers' LlamaConfig gave it (4 key-value heads: full attention)."""
    cfg = {k: v for k, v in QWEN2.items() if k not in ("num_key_value_heads", "max_position_embeddings",
                                                      "tie_word_embeddings")} | {"model_type": "llama"}
    (tmp_path / "llama_defaults.json").write_text(json.dumps(cfg))
    plan, out = _solve(tmp_path, str(tmp_path / "llama_defaults.json"), 64, "1e12", capsys)
    expected = ("model config 'llama-llama_defaults' leaves out num_key_value_heads, max_position_embeddings, "
                "tie_word_embeddings: planned with LlamaConfig's defaults (num_key_value_heads=4, "
                "max_position_embeddings=2048, tie_word_embeddings=False); give them in the config if the model "
                "has others")
    assert own(plan.warnings) == (expected,)
    assert own(json.loads((tmp_path / "plan-64.json").read_text())["warnings"]) == (expected,)
    assert f"  warning: {expected}" in out.splitlines()


def test_a_preset_beyond_its_positions_is_warned_once(folder, tmp_path, capsys, cpu_profile):
    """tiny-llama is configured for 4,096 positions: a plan at 8,192 carries the warning; facts added
    twice (solve, then the CLI) give it once. A preset's plan holds no config."""
    plan, _ = _solve(tmp_path, str(folder), 128, "1e12", capsys)
    at_8k = dataclasses.replace(plan, model="tiny-llama", hf_config=None,
                                decisions=dataclasses.replace(plan.decisions, seq_len=8192))
    warned = with_model_facts(with_model_facts(at_8k, "tiny-llama"), "tiny-llama")
    assert warned.hf_config is None and len(own(warned.warnings)) == 1
    assert own(warned.warnings)[0].startswith("seq_len=8,192 is beyond tiny-llama's max_position_embeddings=4,096")


def test_run_rebuilds_the_configs_model_and_exports_it(folder, tmp_path, capsys, monkeypatch, cpu_profile,
                                                       one_thread):
    """A plan of a few steps at seq 64, run on a token file of ids < 512: the run trains the
    config's model (its plan.json keeps the config), and export-weights writes a Qwen2 folder."""
    from transformers import AutoConfig

    monkeypatch.chdir(tmp_path)
    plan, _ = _solve(tmp_path, str(folder / "config.json"), 64, "4e8", capsys)
    assert own(plan.warnings) == () and plan.decisions.max_steps <= 10, plan.decisions
    np.random.default_rng(0).integers(0, 512, size=20_000).astype(np.uint16).tofile("tokens.bin")
    assert cli.main(["run", str(tmp_path / "plan-64.json"), "--out", "run", "--data", "tokens.bin", "--quiet"]) == 0
    rec = RunRecord.from_json(tmp_path / "run" / "record.json")
    assert rec.model == "qwen2-tinyq" and rec.steps == plan.decisions.max_steps
    assert Plan.from_json(tmp_path / "run" / "plan.json").hf_config == QWEN2
    capsys.readouterr()
    assert cli.main(["export-weights", "run", "--out", "weights", "--quiet"]) == 0
    exported = AutoConfig.from_pretrained(tmp_path / "weights")
    assert exported.model_type == "qwen2"
    assert (exported.hidden_size, exported.num_hidden_layers, exported.vocab_size) == (64, 2, 512)


def test_run_refuses_a_plan_whose_config_was_edited(folder, tmp_path, capsys, cpu_profile):
    _solve(tmp_path, str(folder), 64, "4e8", capsys)
    raw = json.loads((tmp_path / "plan-64.json").read_text())
    raw["hf_config"]["intermediate_size"] = 352
    (tmp_path / "edited.json").write_text(json.dumps(raw))
    assert cli.main(["run", str(tmp_path / "edited.json"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("trainplan: error: plan says model qwen2-tinyq has"), err
    assert "its hf_config at vocab_size=512 builds" in err and "solve it again" in err
