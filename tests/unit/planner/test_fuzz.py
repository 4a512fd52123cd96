"""Fuzz: random models through capture and planning end in a plan or a `TrainplanError`, never
another exception.

- random small modules laid out like an HF causal LM (the layout `trainplan.planner.capture.graph` reads), whose
  blocks are random stacks of Linear / ReLU / GELU / LayerNorm with residual adds and random
  widths;
- random small Llama configs (transformers `LlamaConfig`: dims, heads, KV heads, layers,
  vocabulary), on random device counts, sequence lengths, budgets and corpus sizes;
- random modules of any other layout (`nn.Sequential` stacks): a `TrainplanError` naming the
  layout trainplan needs;
- blocks with graph breaks (branching on a tensor's value, `.item()`, data-dependent shapes): a
  `CaptureError`.
"""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from tests.support import Rotary
from trainplan.errors import CaptureError, TrainplanError
from trainplan.planner.api import solve
from trainplan.planner.budget import Budget

FUZZ = settings(max_examples=8, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])
POLICIES = ("none", "full")  # the solved remat menu is not what is fuzzed here; it is slow


def _layer(kind: str, d_in: int, width: int) -> tuple[nn.Module, int]:
    if kind == "linear":
        return nn.Linear(d_in, width), width
    return {"relu": nn.ReLU(), "gelu": nn.GELU(), "layernorm": nn.LayerNorm(d_in)}[kind], d_in


class Residual(nn.Module):
    """x + body(x), the body's last Linear mapping back to x's width."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, x):
        return x + self.body(x)


class RandomBlock(nn.Module):
    """A random stack of units; `break_kind` adds a graph break."""

    def __init__(self, d: int, units: list[tuple[str, int]], residual: bool, break_kind: str = ""):
        super().__init__()
        layers, width = [], d
        for kind, w in units:
            layer, width = _layer(kind, width, w)
            layers.append(layer)
        layers.append(nn.Linear(width, d))
        body = nn.Sequential(*layers)
        self.body = Residual(body) if residual else body
        self.break_kind = break_kind

    def forward(self, x, position_embeddings=None, position_ids=None, attention_mask=None, **kw):
        h = self.body(x)
        if self.break_kind == "branch" and h.sum() > 0:
            h = -h
        elif self.break_kind == "item":
            h = h * h.abs().max().item()
        elif self.break_kind == "nonzero":
            h = h[torch.nonzero(h > 0, as_tuple=True)].sum() + h
        return h


class RandomLM(nn.Module):
    def __init__(self, vocab: int, d: int, blocks: list[nn.Module], n_heads: int = 2):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, d)
        self.model.layers = nn.ModuleList(blocks)
        self.model.norm = nn.LayerNorm(d)
        self.model.rotary_emb = Rotary(8)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.config = types.SimpleNamespace(num_attention_heads=n_heads, num_key_value_heads=n_heads,
                                            hidden_size=d, vocab_size=vocab, head_dim=8)

    def forward(self, input_ids):
        x = self.model.embed_tokens(input_ids)
        for block in self.model.layers:
            x = block(x)
        return self.lm_head(self.model.norm(x))


UNIT = st.tuples(st.sampled_from(["linear", "relu", "gelu", "layernorm"]), st.integers(4, 48))
BLOCK = st.tuples(st.lists(UNIT, min_size=0, max_size=4), st.booleans())


def _check(plan) -> None:
    d, p = plan.decisions, plan.predictions
    assert d.sp_degree * d.dp_degree == d.devices and d.max_steps >= 1
    assert len(d.activation_checkpoint) == plan.model_n_layers
    assert p.memory_bytes["total"] <= p.memory_limit_bytes * (1 + 1e-9)
    assert p.flops_per_step > 0 and p.step_time_s > 0


def _plan_or_trainplan_error(model, **kw) -> None:
    try:
        plan = solve(model, "h100", policies=POLICIES, time_limit_s=5.0, **kw)
    except TrainplanError as e:
        assert str(e) and "\n" not in str(e), repr(e)
        return
    _check(plan)


@FUZZ
@given(d=st.sampled_from([16, 24, 32, 40]), vocab=st.integers(16, 200),
       blocks=st.lists(BLOCK, min_size=1, max_size=3), seq_len=st.sampled_from([16, 32, 48, 64]),
       devices=st.integers(1, 4), seconds=st.floats(1e-3, 1e4))
def test_random_block_stacks_plan_or_raise(d, vocab, blocks, seq_len, devices, seconds):
    torch.manual_seed(0)
    model = RandomLM(vocab, d, [RandomBlock(d, units, res) for units, res in blocks])
    _plan_or_trainplan_error(model, budget=Budget(devices=devices, wall_clock_s=seconds), seq_len=seq_len)


@FUZZ
@given(head_dim=st.sampled_from([8, 16]), n_kv=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 2, 3]),
       inter=st.integers(8, 96), layers=st.integers(1, 3), vocab=st.integers(64, 600),
       seq_len=st.sampled_from([8, 24, 32, 100, 128]), devices=st.sampled_from([1, 2, 3, 4, 8]),
       budget=st.sampled_from([("wall_clock_s", 1e-4), ("wall_clock_s", 600.0), ("flops", 1e12),
                               ("flops", 1e17), ("device_hours", 1.0)]),
       data_tokens=st.one_of(st.none(), st.integers(-5, 10**6)))
def test_random_llama_configs_plan_or_raise(head_dim, n_kv, group, inter, layers, vocab, seq_len,
                                            devices, budget, data_tokens):
    import transformers

    n_heads = n_kv * group
    cfg = transformers.LlamaConfig(hidden_size=n_heads * head_dim, intermediate_size=inter,
                                   num_hidden_layers=layers, num_attention_heads=n_heads,
                                   num_key_value_heads=n_kv, vocab_size=vocab,
                                   max_position_embeddings=256, use_cache=False)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    kind, value = budget
    _plan_or_trainplan_error(model, budget=Budget(devices=devices, **{kind: value}), seq_len=seq_len,
                             data_tokens=data_tokens)


@FUZZ
@given(units=st.lists(UNIT, min_size=1, max_size=5), d=st.integers(4, 32))
def test_other_layouts_raise_a_trainplan_error(units, d):
    layers, width = [], d
    for kind, w in units:
        layer, width = _layer(kind, width, w)
        layers.append(layer)
    with pytest.raises(TrainplanError, match="cannot capture Sequential.*no nn.ModuleList of blocks"):
        solve(nn.Sequential(*layers), "h100", Budget(wall_clock_s=60), seq_len=32)


@pytest.mark.parametrize("break_kind", ["branch", "item", "nonzero"])
def test_graph_breaks_raise_a_capture_error(break_kind):
    blocks = [RandomBlock(32, [("linear", 40), ("gelu", 0)], True, break_kind)]
    with pytest.raises(CaptureError, match="cannot capture RandomLM: tracing its forward"):
        solve(RandomLM(64, 32, blocks), "h100", Budget(wall_clock_s=60), seq_len=32, policies=POLICIES)
