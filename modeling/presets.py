"""Model presets: real architectures built from HF `transformers` configs on the meta device.

Nothing is downloaded: each preset is the config's architecture numbers written out here, each
with its source (the model's published `config.json`). `build_model` instantiates the
architecture on the meta device (no memory) for planning, or on a real device with random
weights for a training run. `transformers` is imported by the functions that build a config or
a model: its import takes seconds, and the preset table, its checks and `sp_degree_note` (the
command line's) need none of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from trainplan.costmodels.step import comm
from trainplan.errors import UnknownNameError


@dataclass(frozen=True, kw_only=True, slots=True)
class Preset:
    name: str
    """Preset name as the CLI spells it."""
    family: str
    """`llama` or `qwen2`: which transformers config and model class."""
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    tie_word_embeddings: bool = False
    rms_norm_eps: float = 1e-5
    source: str
    """Where the numbers come from."""


_PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(name="llama3-8b", family="llama", hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
               source="meta-llama/Meta-Llama-3-8B config.json"),
        Preset(name="llama3.1-8b", family="llama", hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
               source="meta-llama/Llama-3.1-8B config.json (rope scaling omitted: it does not change shapes or costs)"),
        Preset(name="llama3-70b", family="llama", hidden_size=8192, intermediate_size=28672,
               num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
               vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
               source="meta-llama/Meta-Llama-3-70B config.json"),
        Preset(name="llama3.1-70b", family="llama", hidden_size=8192, intermediate_size=28672,
               num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
               vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
               source="meta-llama/Llama-3.1-70B config.json"),
        Preset(name="llama3.1-405b", family="llama", hidden_size=16384, intermediate_size=53248,
               num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
               vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
               source="meta-llama/Llama-3.1-405B config.json"),
        Preset(name="qwen2.5-7b", family="qwen2", hidden_size=3584, intermediate_size=18944,
               num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               vocab_size=152064, max_position_embeddings=131072, rope_theta=1000000.0,
               rms_norm_eps=1e-6, source="Qwen/Qwen2.5-7B config.json"),
        # Sized to train for a few minutes on 2 CPU cores; vocab matches the default BPE.
        Preset(name="tiny-llama", family="llama", hidden_size=256, intermediate_size=688,
               num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
               vocab_size=8192, max_position_embeddings=4096, rope_theta=10000.0,
               source="trainplan's CPU preset: Llama architecture, small dimensions"),
    )
}


def known_presets() -> list[str]:
    """Names of all presets, sorted."""
    return sorted(_PRESETS)


def get_preset(name: str) -> Preset:
    """The preset called `name` (case-insensitive).

    Raises:
        UnknownNameError: `name` is not a preset; the message lists the known ones.
    """
    key = name.strip().lower()
    if key not in _PRESETS:
        raise UnknownNameError(
            f"unknown model preset {name!r}: known presets are {', '.join(known_presets())}")
    return _PRESETS[key]


def hf_config(preset: Preset, *, vocab_size: int | None = None):
    """The transformers config for `preset`, attention through SDPA; `vocab_size` overrides
    the preset's (a run uses its tokenizer's vocabulary)."""
    import transformers

    cls: Callable = (transformers.LlamaConfig if preset.family == "llama"
                     else transformers.Qwen2Config)
    cfg = cls(
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        vocab_size=vocab_size or preset.vocab_size,
        max_position_embeddings=preset.max_position_embeddings,
        rope_theta=preset.rope_theta,
        rms_norm_eps=preset.rms_norm_eps,
        tie_word_embeddings=preset.tie_word_embeddings,
        use_cache=False,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def build_model(name: str, *, device: str | torch.device = "meta", dtype: torch.dtype = torch.float32,
                vocab_size: int | None = None, seed: int = 0) -> nn.Module:
    """Instantiate preset `name` as a `transformers` causal LM.

    On `device="meta"` no memory is allocated (planning a 405B model is free); on a real
    device the weights are randomly initialised with `seed` (training from scratch). Parameters
    and buffers take `dtype`, except the rotary `inv_freq` buffers, which stay fp32 as
    transformers keeps them when it loads a model (`.to(bf16)` would round the frequencies by
    up to 0.4%: 0.7 rad of rotation error at position 4,000).

    Raises:
        UnknownNameError: unknown preset.
    """
    import transformers

    preset = get_preset(name)
    cfg = hf_config(preset, vocab_size=vocab_size)
    cls = (transformers.LlamaForCausalLM if preset.family == "llama"
           else transformers.Qwen2ForCausalLM)
    if str(device) == "meta":
        with torch.device("meta"):
            model = cls(cfg)
    else:
        torch.manual_seed(seed)
        with torch.device(device):
            model = cls(cfg)
    cast_keeping_rotary(model, dtype)
    model.config.use_cache = False
    # how a Plan recognises the model it was made for (torch's stub types module attributes as
    # tensors or modules)
    model.trainplan_preset = preset.name  # type: ignore[assignment]
    return model


def cast_keeping_rotary(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model` (in place, and returned) with its parameters and buffers cast to `dtype`, except
    the rotary `inv_freq` buffers, which stay fp32 as transformers keeps them when it loads a
    model (`.to(bf16)` would round the frequencies by up to 0.4%: 0.7 rad of rotation error at
    position 4,000)."""
    rotary = {name: buf for name, buf in model.named_buffers() if name.endswith("inv_freq")}
    model.to(dtype=dtype)
    for name, buf in rotary.items():  # RoPE frequencies stay fp32, as transformers loads them
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner).register_buffer(attr, buf, persistent=False)
    return model


def preset_n_params(name: str, *, vocab_size: int | None = None) -> int:
    """Parameters of preset `name` (built on the meta device: no memory, well under a second
    for the presets here).

    Raises:
        UnknownNameError: unknown preset.
    """
    return sum(p.numel() for p in build_model(name, device="meta", vocab_size=vocab_size).parameters())


def sp_degree_note(*, n_heads: int, n_kv_heads: int, devices: int, seq_len: int) -> str:
    """A hint when `seq_len` rules out sequence-parallel degrees that `devices` and the heads
    would allow (Ulysses shards the sequence, so the degree must divide it), else "".

    E.g. 8 devices, 32 heads, seq_len 131070: "seq_len=131070 limits sp_degree to 1, 2 (the
    degree must divide the sequence); a seq_len divisible by 8, e.g. 131072, allows sp_degree
    up to 8"."""
    if seq_len < 1 or devices < 1 or n_heads < 1 or n_kv_heads < 1 or n_heads % n_kv_heads:
        return ""
    by_heads = [p for p in comm.valid_sp_degrees(n_heads, n_heads, n_kv_heads) if devices % p == 0]
    allowed = [p for p in comm.valid_sp_degrees(seq_len, n_heads, n_kv_heads) if devices % p == 0]
    if len(allowed) == len(by_heads):
        return ""
    top = max(by_heads)
    nearest = -(-seq_len // top) * top
    return (f"seq_len={seq_len} limits sp_degree to {', '.join(map(str, allowed))} (the degree must "
            f"divide the sequence); a seq_len divisible by {top}, e.g. {nearest}, allows sp_degree "
            f"up to {top}")
