"""trainplan.modeling.configs: a causal LM built from a transformers config dict or config.json (no
download), its name and stored config, the attention it runs, its dtype and seed; the typed
errors of a config that cannot be read or built; the positions a model was configured for."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from torch import nn

from trainplan.errors import ModelConfigError
from trainplan.modeling.configs import (
    build_from_config,
    check_config,
    config_n_params,
    config_name,
    load_config,
    max_positions,
    position_warning,
)

QWEN2 = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 128}
"""A tiny Qwen2: 2 layers, hidden 64, GQA 4/2 heads."""


@pytest.fixture()
def folder(tmp_path):
    d = tmp_path / "tinyq"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN2))
    return d


def test_load_config_reads_a_file_or_its_folder(folder):
    assert load_config(folder / "config.json") == QWEN2
    assert load_config(folder) == QWEN2
    assert load_config(str(folder)) == QWEN2


def test_config_name_prefers_the_configs_own_then_the_file():
    assert config_name(QWEN2) == "qwen2"
    assert config_name(QWEN2, "some/where/tinyq/config.json") == "qwen2-tinyq"
    assert config_name(QWEN2, "some/where/my-model.json") == "qwen2-my-model"
    assert config_name({**QWEN2, "_name_or_path": "Qwen/Qwen2.5-0.5B"}, "x/config.json") == "Qwen/Qwen2.5-0.5B"


def test_config_name_of_a_folder_is_the_folders(folder):
    assert config_name(QWEN2, folder) == "qwen2-tinyq"


def test_build_on_meta_is_the_transformers_model():
    model = build_from_config(QWEN2, name="qwen2-tinyq")
    assert isinstance(model, transformers.Qwen2ForCausalLM)
    assert all(p.device.type == "meta" and p.dtype == torch.float32 for p in model.parameters())
    ref = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{k: v for k, v in QWEN2.items()
                                                                    if k != "model_type"}))
    assert config_n_params(QWEN2) == sum(p.numel() for p in ref.parameters())
    assert model.config._attn_implementation == "sdpa" and model.config.use_cache is False
    assert model.trainplan_config == QWEN2 and model.trainplan_preset == "qwen2-tinyq"
    assert build_from_config(QWEN2).trainplan_preset == "qwen2"


def test_vocab_size_overrides_the_configs_and_is_stored():
    model = build_from_config(QWEN2, vocab_size=300)
    assert model.get_input_embeddings().weight.shape == (300, 64)
    assert model.trainplan_config == {**QWEN2, "vocab_size": 300}
    assert QWEN2["vocab_size"] == 512  # the caller's dict is not changed


def test_dtype_keeps_the_rotary_frequencies_fp32_whatever_the_config_names():
    """A config's `dtype` (bf16 in most published config.json files) does not set the build's:
    fp32 unless asked; asked for bf16, the rotary inv_freq buffers stay fp32."""
    fp32 = build_from_config({**QWEN2, "dtype": "bfloat16"})
    assert {p.dtype for p in fp32.parameters()} == {torch.float32}
    bf16 = build_from_config(QWEN2, dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    freqs = {n: b.dtype for n, b in bf16.named_buffers() if n.endswith("inv_freq")}
    assert freqs and set(freqs.values()) == {torch.float32}, freqs


def test_seeded_weights_on_a_real_device():
    a, b = (build_from_config(QWEN2, device="cpu", seed=3) for _ in range(2))
    c = build_from_config(QWEN2, device="cpu", seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_a_vocabulary_given_beside_the_config_counts_as_given():
    """A run passes its tokenizer's vocabulary (`vocab_size=`): a config without one builds."""
    cfg = {k: v for k, v in QWEN2.items() if k != "vocab_size"}
    assert build_from_config(cfg, vocab_size=300).config.vocab_size == 300
    with pytest.raises(ModelConfigError, match="leaves out vocab_size"):
        build_from_config(cfg)


def test_a_class_that_refuses_sdpa_runs_eager():
    gemma2 = build_from_config({"model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "head_dim": 16, "vocab_size": 256})
    assert gemma2.config._attn_implementation == "eager"


def test_max_positions_of_presets_modules_and_gpt2():
    assert max_positions("tiny-llama") == 4096
    assert max_positions("no-such-preset") is None
    assert max_positions(build_from_config(QWEN2)) == 128
    gpt2 = build_from_config({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256,
                              "n_positions": 96, "bos_token_id": 0, "eos_token_id": 0})
    assert max_positions(gpt2) == 96
    assert max_positions(nn.Linear(2, 2)) is None


def test_position_warning_only_beyond_the_positions():
    assert position_warning("m", 128, 128) == "" and position_warning("m", None, 10**6) == ""
    line = position_warning("qwen2-tinyq", 128, 256)
    assert "\n" not in line
    assert line.startswith("seq_len=256 is beyond qwen2-tinyq's max_position_embeddings=128"), line
    assert "--seq-len 128 or less" in line


BAD_DICTS = {
    "not-a-dict": ([1, 2], ["is a JSON list, not an object"]),
    "no-model-type": ({"hidden_size": 64}, ["has no model_type", "llama", "qwen2", "causal-LM types"]),
    "model-type-not-a-string": ({"model_type": 3}, ["has model_type=3", "llama"]),
    "unknown-model-type": ({"model_type": "qwen"}, ["model_type 'qwen' is not known to transformers",
                                                    "did you mean", "'qwen2'", "llama"]),
    "not-a-causal-lm": ({"model_type": "t5"}, ["model_type 't5' (T5Config) is not a causal language model",
                                               "AutoModelForCausalLM", "llama"]),
    "size-fields-missing": ({"model_type": "llama", "num_hidden_layers": 4},
                            ["(llama) leaves out hidden_size, num_attention_heads, vocab_size, intermediate_size:",
                             "LlamaConfig: hidden_size=4096", "vocab_size=32000"]),
    "size-fields-missing-by-the-architectures-names": (
        {"model_type": "gpt2", "n_embd": 64, "vocab_size": 256},
        ["(gpt2) leaves out n_head, n_layer:", "GPT2Config: n_head=12, n_layer=12"]),
    "kv-heads-of-a-numeric-default-missing": ({k: v for k, v in QWEN2.items() if k != "num_key_value_heads"},
                                              ["(qwen2) leaves out num_key_value_heads:", "num_key_value_heads=32"]),
    "text-config-sizes-missing": ({"model_type": "gemma3", "text_config": {"hidden_size": 64}},
                                  ["(gemma3) leaves out text_config.num_attention_heads, "
                                   "text_config.num_hidden_layers, text_config.vocab_size"]),
    "values-transformers-refuses": ({**QWEN2, "model_type": "llama", "hidden_size": 65},
                                    ["transformers cannot build a llama model", "65",
                                     "not a multiple of the number of attention heads"]),
}


@pytest.mark.parametrize("cfg, needles", BAD_DICTS.values(), ids=BAD_DICTS.keys())
def test_a_bad_config_is_one_typed_line(cfg, needles):
    with pytest.raises(ModelConfigError) as e:
        build_from_config(cfg)
    msg = str(e.value)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_bad_files_name_the_path_and_what_is_valid(tmp_path):
    (tmp_path / "bad.json").write_text("not json {")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "empty").mkdir()
    (tmp_path / "t5.json").write_text(json.dumps({"model_type": "t5"}))
    cases = {tmp_path / "missing.json": ["missing.json' does not exist", "config.json", "nothing is downloaded"],
             tmp_path / "bad.json": ["bad.json' is not a JSON file", "Expecting value", '"model_type": "llama"'],
             tmp_path / "binary.json": ["binary.json' is not a JSON file"],
             tmp_path / "empty": ["empty' is a folder without config.json"],
             tmp_path / "t5.json": ["t5.json': model_type 't5'", "not a causal language model"]}
    for path, needles in cases.items():
        with pytest.raises(ModelConfigError) as e:
            load_config(path)
        msg = str(e.value)
        assert msg.startswith(f"model config {str(path)!r}") and "\n" not in msg, msg
        for needle in needles:
            assert needle in msg, (needle, msg)


def test_check_config_returns_the_model_type():
    assert check_config(QWEN2) == "qwen2"
