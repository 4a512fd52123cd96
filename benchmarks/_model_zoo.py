"""The architectures of issue #20's benchmark (`benchmarks/models.py`): for each a tiny config,
trained for real on a CPU, and the published full-size config, planned on the meta device.

Every config is a transformers config dict: `model_type` plus the fields of that model's
`config.json` (`build_model` turns it into a model: `trainplan.modeling.configs.build_from_config`, i.e.
`transformers.AutoConfig.for_model` and `AutoModelForCausalLM.from_config`). The full-size ones
copy the architecture fields of the model's published config.json on the Hugging Face Hub
(`Arch.source`; token ids, dtype and generation fields left out); the tiny ones keep each
architecture's features (GQA, sliding windows below the benchmark's sequences, softcapping, QK
norms, parallel residuals, partial rotary, learned positions, tied embeddings, routed experts) at
2 layers, hidden 64, and take the benchmark tokenizer's vocabulary (`tiny_model(arch, vocab_size)`).

One architecture is not a transformers model: `NanoGPT`, a nanoGPT-style module written here
(`model_type` "nanogpt"): a user's own `nn.Module` with no config object and no HF layout.

Tests import it as `benchmarks._model_zoo` (the repository root is on pytest's path):

    from benchmarks._model_zoo import ARCHS, tiny_model
    model = tiny_model("mistral", vocab_size=512)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

HF = "https://huggingface.co/{}/blob/main/config.json"


@dataclass(frozen=True)
class Arch:
    """One architecture of the benchmark."""

    name: str
    """Short key: `llama`, `mistral`, ... (the CSV's `arch`)."""
    title: str
    """What a reader calls it."""
    tiny: dict[str, Any]
    """The tiny config (no `vocab_size`: the benchmark tokenizer's is set by `tiny_model`)."""
    full: dict[str, Any]
    """The published full-size config."""
    source: str
    """Where `full` comes from (the published config.json's address)."""
    features: tuple[str, ...] = field(default=())
    """What the architecture adds to a Llama-style decoder (for the report)."""


def _hf(repo: str) -> str:
    return HF.format(repo)


ARCHS: dict[str, Arch] = {a.name: a for a in (
    Arch(
        "llama", "Llama 3.1",
        tiny=dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False),
        # meta-llama/Llama-3.1-8B config.json
        full=dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                  max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=8192),
                  hidden_act="silu", attention_bias=False, mlp_bias=False, tie_word_embeddings=False),
        source=_hf("meta-llama/Llama-3.1-8B"), features=("GQA", "llama3 RoPE scaling")),
    Arch(
        "mistral", "Mistral",
        # the window (32) below both benchmark sequences (64, 128): banded attention
        tiny=dict(model_type="mistral", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  sliding_window=32, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False),
        # mistralai/Mistral-7B-v0.1 config.json
        full=dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                  max_position_embeddings=32768, sliding_window=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
                  hidden_act="silu", tie_word_embeddings=False),
        source=_hf("mistralai/Mistral-7B-v0.1"), features=("GQA", "sliding window")),
    Arch(
        "qwen2", "Qwen2",
        tiny=dict(model_type="qwen2", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, use_sliding_window=False, tie_word_embeddings=False),
        # Qwen/Qwen2-7B config.json
        full=dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                  num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                  max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  sliding_window=131072, use_sliding_window=False, max_window_layers=28, hidden_act="silu",
                  tie_word_embeddings=False),
        source=_hf("Qwen/Qwen2-7B"), features=("GQA", "QKV bias")),
    Arch(
        "qwen3", "Qwen3",
        tiny=dict(model_type="qwen3", hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False),
        # Qwen/Qwen3-8B config.json
        full=dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                  max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, attention_bias=False,
                  use_sliding_window=False, sliding_window=None, max_window_layers=36, hidden_act="silu",
                  tie_word_embeddings=False),
        source=_hf("Qwen/Qwen3-8B"), features=("GQA", "QK norm")),
    Arch(
        "gemma", "Gemma",
        tiny=dict(model_type="gemma", hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=512,
                  rms_norm_eps=1e-6, rope_theta=10000.0, hidden_activation="gelu_pytorch_tanh"),
        # google/gemma-7b config.json (tied embeddings: the config's default)
        full=dict(model_type="gemma", hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=16, head_dim=256, vocab_size=256000,
                  max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="gelu",
                  attention_bias=False),
        source=_hf("google/gemma-7b"), features=("embedding scale buffer", "tied embeddings", "GeGLU")),
    Arch(
        "gemma2", "Gemma 2",
        # local/global alternation: layer 0 slides (window 32), layer 1 is global
        tiny=dict(model_type="gemma2", hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  sliding_window=32, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                  query_pre_attn_scalar=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                  hidden_activation="gelu_pytorch_tanh"),
        # google/gemma-2-9b config.json
        full=dict(model_type="gemma2", hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=256000,
                  max_position_embeddings=8192, sliding_window=4096, attn_logit_softcapping=50.0,
                  final_logit_softcapping=30.0, query_pre_attn_scalar=256, rms_norm_eps=1e-6, rope_theta=10000.0,
                  hidden_activation="gelu_pytorch_tanh", attention_bias=False),
        source=_hf("google/gemma-2-9b"),
        features=("local/global sliding window", "attention and final-logit softcapping", "sandwich norms",
                  "embedding scale", "tied embeddings", "eager attention")),
    Arch(
        "phi3", "Phi-3",
        # published window 2047 of 4096 positions; here 48, below both benchmark sequences
        tiny=dict(model_type="phi3", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                  original_max_position_embeddings=512, sliding_window=48, rms_norm_eps=1e-5, rope_theta=10000.0,
                  tie_word_embeddings=False),
        # microsoft/Phi-3-mini-4k-instruct config.json
        full=dict(model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096,
                  original_max_position_embeddings=4096, sliding_window=2047, rms_norm_eps=1e-5,
                  rope_theta=10000.0, rope_scaling=None, hidden_act="silu", attention_bias=False,
                  tie_word_embeddings=False),
        source=_hf("microsoft/Phi-3-mini-4k-instruct"), features=("fused QKV and gate-up", "sliding window")),
    Arch(
        "olmo2", "OLMo 2",
        tiny=dict(model_type="olmo2", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                  rms_norm_eps=1e-6, rope_theta=500000.0, tie_word_embeddings=False),
        # allenai/OLMo-2-1124-7B config.json
        full=dict(model_type="olmo2", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, vocab_size=100352, max_position_embeddings=4096,
                  rms_norm_eps=1e-6, rope_theta=500000.0, hidden_act="silu", attention_bias=False,
                  tie_word_embeddings=False),
        source=_hf("allenai/OLMo-2-1124-7B"), features=("post-norms", "QK norm over all heads")),
    Arch(
        "gpt2", "GPT-2",
        tiny=dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=512,
                  activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        # openai-community/gpt2-xl config.json (dropout off for a deterministic benchmark; published 0.1)
        full=dict(model_type="gpt2", n_embd=1600, n_layer=48, n_head=25, n_positions=1024, n_ctx=1024,
                  vocab_size=50257, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        source=_hf("openai-community/gpt2-xl"),
        features=("learned positions", "LayerNorm", "Conv1D layers", "tied embeddings", "GELU MLP")),
    Arch(
        "gpt_neox", "GPT-NeoX (Pythia)",
        tiny=dict(model_type="gpt_neox", hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=512, rotary_pct=0.25, rotary_emb_base=10000,
                  use_parallel_residual=True, layer_norm_eps=1e-5, hidden_act="gelu", tie_word_embeddings=False,
                  attention_dropout=0.0, hidden_dropout=0.0),
        # EleutherAI/pythia-6.9b config.json
        full=dict(model_type="gpt_neox", hidden_size=4096, intermediate_size=16384, num_hidden_layers=32,
                  num_attention_heads=32, vocab_size=50432, max_position_embeddings=2048, rotary_pct=0.25,
                  rotary_emb_base=10000, use_parallel_residual=True, layer_norm_eps=1e-5, hidden_act="gelu",
                  tie_word_embeddings=False),
        source=_hf("EleutherAI/pythia-6.9b"),
        features=("parallel residual", "partial rotary (25%)", "fused QKV", "LayerNorm")),
    Arch(
        "mixtral", "Mixtral (MoE)",
        tiny=dict(model_type="mixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                  max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None,
                  router_aux_loss_coef=0.02, tie_word_embeddings=False),
        # mistralai/Mixtral-8x7B-v0.1 config.json
        full=dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                  vocab_size=32000, max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0,
                  sliding_window=None, router_aux_loss_coef=0.02, hidden_act="silu", tie_word_embeddings=False),
        source=_hf("mistralai/Mixtral-8x7B-v0.1"), features=("top-2 of 8 routed experts", "GQA")),
    Arch(
        "nanogpt", "nanoGPT-style module",
        tiny=dict(model_type="nanogpt", n_layer=2, n_head=4, n_embd=64, block_size=512, bias=True),
        # karpathy/nanoGPT model.py, GPTConfig's defaults: GPT-2 124M with the vocabulary padded to 50304
        full=dict(model_type="nanogpt", n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304,
                  bias=True),
        source="https://github.com/karpathy/nanoGPT/blob/master/model.py (GPTConfig)",
        features=("a user's own nn.Module: no config object, no HF layout", "learned positions",
                  "tied embeddings")),
)}
"""The benchmark's architectures, in its order."""


# --- nanoGPT ----------------------------------------------------------------------------------

class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, bias: bool):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, n_embd: int, bias: bool):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, bias: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """A GPT as nanoGPT writes it (karpathy/nanoGPT `model.py`, dropout 0): `transformer.wte`,
    `transformer.wpe`, `transformer.h` (blocks of LayerNorm, causal self-attention through
    `F.scaled_dot_product_attention(is_causal=True)`, LayerNorm, GELU MLP), `transformer.ln_f`,
    and `lm_head` tied to `wte`. No config object: what a user brings.

    forward(idx, targets=None): the logits (b, s, vocab) for token ids `idx` (b, s); with
    `targets` (b, s), the mean cross-entropy instead (ignore index -1, nanoGPT's)."""

    def __init__(self, vocab_size: int, n_layer: int = 12, n_head: int = 12, n_embd: int = 768,
                 block_size: int = 1024, bias: bool = True):
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head, bias) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd, bias=bias),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)


# --- building ---------------------------------------------------------------------------------

def attn_implementation(model_type: str) -> str:
    """"sdpa" where the transformers class supports it, else "eager" (Gemma 2: softcapping)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(transformers.AutoConfig.for_model(model_type))]
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def build_model(config: dict[str, Any], device: str | torch.device = "cpu", seed: int = 0,
                dtype: torch.dtype = torch.float32, name: str | None = None) -> nn.Module:
    """The model of a config dict (`model_type` + fields) on `device` ("meta" for planning,
    "cpu" to train), its weights drawn after `torch.manual_seed(seed)`, in `dtype`, in train mode.

    transformers models: `trainplan.modeling.configs.build_from_config` where the tree has it (the module
    then carries its config and `name` for a plan), else `AutoConfig.for_model` +
    `AutoModelForCausalLM.from_config` here; either way `attn_implementation` "sdpa" where the
    class supports it, else "eager", and no KV cache. "nanogpt": `NanoGPT`."""
    fields = dict(config)
    model_type = fields.pop("model_type")
    if model_type != "nanogpt":
        try:
            from trainplan.modeling.configs import build_from_config
        except ImportError:
            pass
        else:
            return build_from_config(config, device=device, dtype=dtype, seed=seed, name=name).train()
    torch.manual_seed(seed)
    with torch.device(device):
        if model_type == "nanogpt":
            model: nn.Module = NanoGPT(**fields)
        else:
            import transformers

            cfg = transformers.AutoConfig.for_model(model_type, **{"use_cache": False, **fields})
            model = transformers.AutoModelForCausalLM.from_config(
                cfg, attn_implementation=attn_implementation(model_type), dtype=dtype)
    return model.to(dtype).train()


def tiny_config(arch: str, vocab_size: int) -> dict[str, Any]:
    """`ARCHS[arch].tiny` with the vocabulary `vocab_size` (and no special-token ids)."""
    if arch not in ARCHS:
        raise KeyError(f"unknown architecture {arch!r}: one of {', '.join(ARCHS)}")
    cfg = {**ARCHS[arch].tiny, "vocab_size": int(vocab_size)}
    if cfg["model_type"] != "nanogpt":  # the published special-token ids may lie outside a small vocabulary
        cfg = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **cfg}
    return cfg


def tiny_model(arch: str, vocab_size: int, device: str | torch.device = "cpu", seed: int = 0) -> nn.Module:
    """The tiny model of `arch` (a key of `ARCHS`) with `vocab_size` tokens, fp32, train mode
    (named `<arch>-tiny`)."""
    return build_model(tiny_config(arch, vocab_size), device=device, seed=seed, name=f"{arch}-tiny")


def full_model(arch: str, device: str | torch.device = "meta") -> nn.Module:
    """The published full-size model of `arch`, by default on the meta device (no memory)."""
    if arch not in ARCHS:
        raise KeyError(f"unknown architecture {arch!r}: one of {', '.join(ARCHS)}")
    return build_model(ARCHS[arch].full, device=device, name=full_name(arch))


def full_name(arch: str) -> str:
    """The full-size model's name: its Hub repository's (`Llama-3.1-8B`), else `<arch>-full`."""
    parts = ARCHS[arch].source.split("/")
    return parts[4] if "huggingface.co" in ARCHS[arch].source else f"{arch}-full"
