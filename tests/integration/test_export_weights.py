"""Weights out (`trainplan export-weights`, `trainplan.executor.weights.export`): a 2-step tiny-llama run
exported to a Hugging Face folder loads with `transformers.AutoModelForCausalLM` and gives the
trained model's logits; its tokenizer loads with `AutoTokenizer` and encodes the corpus as the
run did; a bf16 run stays bf16 unless `--dtype` says otherwise; bad folders are refused.
Exports of two-process checkpoints (FSDP2, DDP) are checked beside the runs that write them:
tests/integration/test_resume.py and tests/integration/test_grad_accum_parallel.py."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import trainplan.planner.cli.main as cli
from tests.support import transformers_heldout_loss
from trainplan.errors import OutputPathError, TrainplanError, UnknownNameError
from trainplan.executor.data.batches import load_corpus
from trainplan.executor.train import run
from trainplan.modeling.presets import build_model
from trainplan.planner.api import plan_for_choice

WORDS = ["now", "is", "the", "winter", "of", "our", "discontent", "made", "glorious", "summer", "by",
         "this", "sun", "of", "york", "and", "all", "the", "clouds", "that", "lowered", "upon", "house"]


@pytest.fixture(scope="module")
def corpus_path(tmp_path_factory) -> Path:
    rng = random.Random(3)
    path = tmp_path_factory.mktemp("corpus") / "york.txt"
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(15)) for _ in range(600)) + "\n",
                    encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def corpus(corpus_path):
    return load_corpus([corpus_path], vocab_size=512)


@pytest.fixture(scope="module")
def trained(corpus, cpu_profile, tmp_path_factory, one_thread):
    """`trained(precision)`: (plan, the model trained in place, run folder) of a 2-step run (cached)."""
    cache: dict = {}

    def get(precision: str):
        if precision not in cache:
            plan = plan_for_choice("tiny-llama", cpu_profile, seq_len=64, micro_batch=2, max_steps=2,
                                   vocab_size=corpus.vocab_size, precision=precision,
                                   optimizer_bits=16 if precision == "bf16" else 32)
            dtype = torch.bfloat16 if precision == "bf16" else torch.float32
            model = build_model(plan.model, device="cpu", dtype=dtype, vocab_size=corpus.vocab_size,
                                seed=plan.decisions.seed)
            out = tmp_path_factory.mktemp(f"run-{precision}")
            run(plan, model, corpus, out=out, device="cpu", progress=False)
            cache[precision] = plan, model.eval(), out
        return cache[precision]

    return get


def _ids(tokens, n: int) -> torch.Tensor:
    """The first `n` ids of a token stream (numpy or torch) as a (1, n) int64 batch."""
    return torch.as_tensor(np.asarray(tokens[:n], dtype=np.int64)).reshape(1, n)


def _logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=x).logits


def test_exported_model_gives_the_trained_logits(trained, corpus, tmp_path, capsys):
    """Through the command line: the folder holds the HF layout; transformers loads an fp32
    LlamaForCausalLM whose logits equal the trained model's (same weights, same kernels) and
    whose held-out loss is the run's final one."""
    from transformers import AutoModelForCausalLM

    plan, model, run_dir = trained("fp32")
    out = tmp_path / "hf"
    assert cli.main(["export-weights", str(run_dir), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"weights: {out}" in printed and f"AutoTokenizer.from_pretrained({str(out)!r})" in printed
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= \
        {p.name for p in out.iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded).__name__ == "LlamaForCausalLM" and loaded.dtype == torch.float32
    x = _ids(corpus.heldout_tokens, 2 * 64).reshape(2, 64)
    torch.testing.assert_close(_logits(loaded, x), _logits(model, x), rtol=0, atol=0)
    record = json.loads((run_dir / "record.json").read_text())
    assert transformers_heldout_loss(out, plan, corpus) == pytest.approx(record["heldout_loss"][-1][2],
                                                                        rel=1e-6)


def test_exported_tokenizer_encodes_like_the_run(trained, corpus, corpus_path, tmp_path):
    """AutoTokenizer reads the run's tokenizer: the corpus text encodes to the run's token stream
    (the one document, then `<|endoftext|>`, which is BOS and EOS of tokenizer and config)."""
    from transformers import AutoConfig, AutoTokenizer

    from trainplan.executor.weights.export import export_weights

    _, _, run_dir = trained("fp32")
    out = export_weights(run_dir, tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(out)
    stream = np.concatenate([np.asarray(corpus.train_tokens), np.asarray(corpus.heldout_tokens)]).tolist()
    assert tok(corpus_path.read_text(encoding="utf-8")).input_ids + [tok.eos_token_id] == stream
    assert tok.eos_token == tok.bos_token == "<|endoftext|>"
    config = AutoConfig.from_pretrained(out)
    assert config.eos_token_id == config.bos_token_id == tok.eos_token_id and config.use_cache


def test_bf16_run_stays_bf16_and_fp32_on_request(trained, corpus, tmp_path):
    """The bf16 run's weights export as bf16, bit for bit; `dtype="fp32"` widens them. RoPE's
    inv_freq is fp32 in both the run (`trainplan.modeling.presets.build_model` keeps it so) and the loaded
    model (transformers does), so the trained model's logits equal the loaded model's."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from trainplan.executor.weights.export import export_weights

    _, model, run_dir = trained("bf16")
    bf16 = export_weights(run_dir, tmp_path / "bf16")
    weights = load_file(bf16 / "model.safetensors")
    params = dict(model.named_parameters())
    assert weights.keys() == params.keys()
    assert all(w.dtype == torch.bfloat16 and torch.equal(w, params[k]) for k, w in weights.items())
    loaded = AutoModelForCausalLM.from_pretrained(bf16)
    assert loaded.dtype == torch.bfloat16
    widened = {k: w.float() for k, w in load_file(export_weights(run_dir, tmp_path / "fp32", dtype="fp32")
                                                  / "model.safetensors").items()}
    assert all(w.dtype == torch.float32 and torch.equal(w, params[k].float()) for k, w in widened.items())
    x = _ids(corpus.heldout_tokens, 64)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    torch.testing.assert_close(_logits(loaded, x), _logits(model, x), rtol=0, atol=0)


def test_bad_folders_and_dtype_are_refused(trained, tmp_path):
    from trainplan.executor.weights.export import export_weights

    _, _, run_dir = trained("fp32")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TrainplanError, match="is not a trainplan run folder .no plan.json."):
        export_weights(tmp_path / "empty", tmp_path / "a")
    with pytest.raises(TrainplanError, match="does not exist or is not a folder"):
        export_weights(tmp_path / "missing", tmp_path / "a")
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputPathError, match="'.*file' is a file"):
        export_weights(run_dir, tmp_path / "file")
    with pytest.raises(UnknownNameError, match="dtype 'fp16' .* valid: bf16, fp32"):
        export_weights(run_dir, tmp_path / "a", dtype="fp16")
    assert not (tmp_path / "a").exists()
    (tmp_path / "out").mkdir()
    assert export_weights(run_dir, tmp_path / "out", dtype=torch.float32) == tmp_path / "out"  # empty: used
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")], "temporary folder left behind"


def _copy_run(run_dir: Path, to: Path) -> tuple[Path, Path]:
    """A copy of the run folder `run_dir` at `to`, and its latest checkpoint there."""
    from trainplan.executor.checkpoint import latest_checkpoint

    shutil.copytree(run_dir, to, symlinks=True)
    ckpt = latest_checkpoint(to)
    assert ckpt is not None and ckpt.is_relative_to(to)
    return to, ckpt


def test_a_run_without_a_tokenizer_prints_the_model_line_alone(trained, tmp_path, capsys):
    """A run on token ids (no tokenizer recorded): the folder has the weights alone, and the
    `load:` line names AutoModelForCausalLM only."""
    from trainplan.executor.checkpoint import META, TOKENIZER

    run_dir, ckpt = _copy_run(trained("fp32")[2], tmp_path / "run")
    (ckpt / TOKENIZER).unlink()
    meta = json.loads((ckpt / META).read_text())
    meta["corpus"]["tokenizer"] = None
    (ckpt / META).write_text(json.dumps(meta))
    out = tmp_path / "hf"
    assert cli.main(["export-weights", str(run_dir), "--out", str(out)]) == 0
    assert "tokenizer.json" not in {p.name for p in out.iterdir()}
    load = [line for line in capsys.readouterr().out.splitlines() if line.startswith("load: ")]
    assert load == [f"load: transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})"], load


def test_a_run_of_a_model_that_is_not_a_preset_says_to_load_it_yourself(trained, tmp_path):
    """Your own model (plan.model its class name): with a checkpoint, how to load it with
    torch.distributed.checkpoint; without one (your own loop), not `trainplan run`, which builds
    presets only."""
    from trainplan.executor.weights.export import export_weights

    plan, _, trained_dir = trained("fp32")
    mine = dataclasses.replace(plan, model="MyCausalLM")
    run_dir, ckpt = _copy_run(trained_dir, tmp_path / "run")
    mine.to_json(run_dir / "plan.json")
    with pytest.raises(UnknownNameError, match=r"'MyCausalLM', which is not a preset .* into your own model with "
                                               r"torch.distributed.checkpoint \(state = \{'model': "):
        export_weights(run_dir, tmp_path / "a")
    shutil.rmtree(run_dir / "checkpoint")
    with pytest.raises(TrainplanError) as e:
        export_weights(run_dir, tmp_path / "a")
    msg = str(e.value)
    assert "'MyCausalLM' is not a preset" in msg and "torch.distributed.checkpoint" in msg, msg
    assert "trainplan run" in msg and "--out DIR" not in msg and "\n" not in msg, msg
    assert not (tmp_path / "a").exists()
