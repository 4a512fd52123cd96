"""The published GPU training measurements of `benchmarks/published.py`: the case file's schema
(pydantic), its loader, and each case as trainplan expresses it (profile, model, knobs).

The case file (`benchmarks/published_cases.toml`) holds one `[[case]]` table per published
measurement, each with its source, the verbatim row or sentence its numbers come from (`quote`),
the model, the hardware and parallelism, and the published throughput and/or memory. A case
that trainplan cannot express (tensor or pipeline parallelism, HSDP, CPU offload, LoRA,
torch.compile, an unpublished checkpoint set) carries `excluded = "reason"` and is listed, not
predicted.

Architectures: a case gives its model's shape. Llama-family models are built as transformers
`LlamaConfig`s. MPT (LLM Foundry's benchmarks: a GELU MLP of 4 x d_model, multi-head attention,
tied embeddings) is built as the Llama-shaped model with the same hidden size, heads and vocabulary
and a SwiGLU width of 8 d / 3, which has the same MLP parameters and matmul FLOPs
(3 x d x 8d/3 = 2 x d x 4d); its LayerNorm, biases and learned position table (under 0.1% of the
FLOPs) are not modelled. `arch_note` in the results says so per case.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

CASES_FILE = Path(__file__).with_name("published_cases.toml")

PROFILE_OF_GPU = {"h100": "h100", "h200": "h200", "a100-80gb": "a100", "a100-40gb": "a100-40gb",
                  "mi300x": "mi300x"}
"""Published GPU name -> the trainplan hardware profile that describes it."""


class Case(BaseModel):
    """One published measurement: a `[[case]]` table of the case file (module docstring). Units
    are in the field names (`_s`, `_bytes`, `tokens_per_s_per_device`); sequences and batches are
    in tokens and sequences.

    Raises (pydantic `ValidationError`, a `ValueError`): an in-scope case missing a knob the
    prediction needs, a GPU without a profile, checkpointing other than none/full, no published
    figure, or memory without its kind."""

    model_config = ConfigDict(extra="allow", frozen=True)

    id: str
    source_id: str
    source: str
    url_text: str = ""
    quote: str
    model_name: str
    family: str
    gpu: str
    devices: int = Field(ge=1)
    devices_per_node: int = Field(default=8, ge=1)
    tp: int = 1
    pp: int = 1
    sp_degree: int = 1
    precision: str
    excluded: str = ""
    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None
    mlp: Literal["gelu", "swiglu"] | None = None
    tie_embeddings: bool = False
    zero_stage: int | None = Field(default=None, ge=0, le=3)
    micro_batch: int | None = None
    global_batch: int | None = None
    seq_len: int | None = None
    checkpointing: str | None = None
    optimizer: str = "adamw"
    optimizer_bits: int | None = None
    node_network_gbps: float | None = None
    """Inter-node bandwidth per node, Gb/s, as the publication states it (replaces the profile's
    per-device NIC share: gbps / 8 / devices_per_node bytes/s)."""
    tokens_per_s_per_device: float | None = None
    step_time_s: float | None = None
    memory_bytes: float | None = None
    memory_kind: Literal["allocated", "reserved", "active", "nvidia-smi"] | None = None

    @model_validator(mode="after")
    def _complete(self) -> Case:
        if self.excluded:
            return self
        need = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                "vocab_size", "mlp", "zero_stage", "micro_batch", "seq_len", "checkpointing")
        missing = [k for k in need if getattr(self, k) is None]
        if missing:
            raise ValueError(f"case {self.id}: in scope but missing {missing}")
        if self.gpu not in PROFILE_OF_GPU:
            raise ValueError(f"case {self.id}: gpu {self.gpu!r} has no profile; known: {sorted(PROFILE_OF_GPU)}")
        if self.checkpointing not in ("none", "full"):
            raise ValueError(f"case {self.id}: checkpointing {self.checkpointing!r}; in scope: none, full")
        if self.tokens_per_s_per_device is None and self.step_time_s is None and self.memory_bytes is None:
            raise ValueError(f"case {self.id}: publishes neither throughput, step time nor memory")
        if self.memory_bytes is not None and self.memory_kind is None:
            raise ValueError(f"case {self.id}: memory_bytes needs memory_kind")
        return self

    @property
    def multinode(self) -> bool:
        return self.devices > self.devices_per_node

    grad_accum: int | None = None
    """Micro-steps per optimizer step as published; else `accumulation` derives it."""

    @property
    def accumulation(self) -> int:
        """Micro-steps per optimizer step: as published, else the published global batch over
        micro-batch x data-parallel ranks (1 when neither is published)."""
        if self.grad_accum:
            return self.grad_accum
        dp = self.devices // self.sp_degree
        if not self.global_batch or not self.micro_batch:
            return 1
        return max(1, self.global_batch // (self.micro_batch * dp))

    @property
    def tokens_per_device_per_step(self) -> float:
        assert self.micro_batch and self.seq_len
        return self.micro_batch * self.seq_len * self.accumulation / self.sp_degree

    @property
    def published_step_time_s(self) -> float | None:
        if self.step_time_s is not None:
            return self.step_time_s
        if self.tokens_per_s_per_device:
            return self.tokens_per_device_per_step / self.tokens_per_s_per_device
        return None

    @property
    def swiglu_width(self) -> int:
        """The Llama-shaped MLP width with this case's MLP parameters (module docstring)."""
        assert self.intermediate_size and self.hidden_size
        return self.intermediate_size if self.mlp == "swiglu" else round(2 * self.intermediate_size / 3)

    @property
    def arch_note(self) -> str:
        if self.mlp == "swiglu":
            return ""
        return (f"{self.family}: GELU MLP {self.intermediate_size} built as SwiGLU {self.swiglu_width} "
                "(same MLP parameters and FLOPs)")


def load_cases(path: Path = CASES_FILE) -> list[Case]:
    """All cases of `path`.

    Raises:
        ValueError: a case breaks the schema (pydantic's message names the case and field), or
            two cases share an id."""
    with path.open("rb") as f:
        raw = tomllib.load(f).get("case", [])
    cases = [Case(**c) for c in raw]
    ids = [c.id for c in cases]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ValueError(f"{path}: duplicate case ids {dup}")
    return cases


def profile_for(case: Case):
    """The case's hardware profile, with the inter-node bandwidth the publication states."""
    from trainplan.hardware_profiles import load

    hw = load(PROFILE_OF_GPU[case.gpu])
    if case.node_network_gbps:
        bw = case.node_network_gbps * 1e9 / 8 / case.devices_per_node
        hw = dataclasses.replace(hw, inter_node_bandwidth_bytes_per_s=bw, devices_per_node=case.devices_per_node)
    return hw


def build_meta_model(case: Case):
    """The case's model on the meta device (a transformers Llama; module docstring)."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=case.hidden_size, intermediate_size=case.swiglu_width,
        num_hidden_layers=case.num_layers, num_attention_heads=case.num_heads,
        num_key_value_heads=case.num_kv_heads, vocab_size=case.vocab_size,
        max_position_embeddings=max(case.seq_len or 0, 2048), tie_word_embeddings=case.tie_embeddings,
        use_cache=False)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    model.trainplan_preset = case.model_name
    return model


def arch_key(case: Case) -> tuple:
    """Cases with one key share one capture."""
    return (case.hidden_size, case.swiglu_width, case.num_layers, case.num_heads, case.num_kv_heads,
            case.vocab_size, case.tie_embeddings, case.precision)
