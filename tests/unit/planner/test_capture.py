"""trainplan.planner.capture.graph: presets capture on fake tensors, identical blocks share a region, node
attributes, and FLOP polynomials that equal FlopCounterMode on a real step, exactly."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from trainplan.costmodels.graph import poly_at
from trainplan.errors import TrainplanError
from trainplan.modeling.flop_counting import CPU_ATTENTION_FLOP_FORMULAS
from trainplan.modeling.loss import lm_loss
from trainplan.modeling.presets import build_model
from trainplan.planner.capture.graph import capture


def _region_names(graph) -> list[str]:
    """Regions in execution order, one entry per layer for the blocks."""
    return ["head", *graph.blocks, "tail"]


def _predicted_flops(graph, b: int, s: int, phase: str | None = None) -> float:
    """Sum of the captured per-node FLOP polynomials at (b, s) over one forward+backward."""
    total = 0.0
    for name in _region_names(graph):
        for _, a in graph.regions[name].graph.nodes(data=True):
            if phase is None or a["phase"] == phase:
                total += poly_at(a["flops"], b, s)
    return total


# ---------------------------------------------------------------- presets


@pytest.mark.parametrize("preset, dtype, n_params, n_layers", [
    ("tiny-llama", torch.float32, 7_096_576, 4),
    # Meta-Llama-3-70B: 70.55B parameters (80 layers, hidden 8192, vocab 128256)
    ("llama3-70b", torch.bfloat16, 70_553_706_496, 80),
])
def test_preset_captures_on_meta(preset, dtype, n_params, n_layers):
    """(How long a capture takes is a benchmark figure: `solve_s_llama3_70b_capture` in
    benchmarks/solve_speed.py.)"""
    model = build_model(preset, device="meta", dtype=dtype)
    g = capture(model, dtype=dtype)
    assert g.name == preset
    assert g.n_params == n_params, f"{preset}: {g.n_params} parameters, expected {n_params}"
    assert g.param_bytes == n_params * dtype.itemsize, (g.param_bytes, n_params * dtype.itemsize)
    # identical blocks: every layer maps to one traced region
    assert g.n_layers == n_layers and g.blocks == ("block0",) * n_layers, g.blocks
    assert g.distinct_blocks == {"block0": n_layers}
    assert set(g.regions) == {"head", "block0", "tail"}
    # the regions hold every parameter once
    in_regions = sum(g.regions[r].param_bytes() for r in _region_names(g))
    assert in_regions == g.param_bytes, f"regions hold {in_regions} parameter bytes, model {g.param_bytes}"


def test_different_blocks_get_their_own_region(tiny_llama):
    model = tiny_llama(device="meta", num_hidden_layers=3)
    cfg = transformers.LlamaConfig(**{**model.config.to_dict(), "intermediate_size": 96})
    with torch.device("meta"):
        model.model.layers[1].mlp = transformers.models.llama.modeling_llama.LlamaMLP(cfg)
    g = capture(model)
    assert g.blocks == ("block0", "block1", "block0"), g.blocks
    assert g.distinct_blocks == {"block0": 2, "block1": 1}
    assert g.regions["block1"].param_bytes() < g.regions["block0"].param_bytes()


def test_sentinel_collision_is_an_error(tiny_llama):
    # every (micro-batch, sequence) sentinel pair has a prime dividing a config integer
    from trainplan.planner.capture.sentinels import SENTINELS
    model = tiny_llama(device="meta", **{f"s{b0}": 3 * b0 for b0, _ in SENTINELS})
    with pytest.raises(TrainplanError, match="sentinel"):
        capture(model)


# ---------------------------------------------------------------- node attributes


def _is_poly(p) -> bool:
    return isinstance(p, tuple) and all(
        isinstance(i, int) and isinstance(j, int) and isinstance(c, float) and i >= 0 and j >= 0
        for i, j, c in p)


def test_node_attributes(tiny_llama):
    g = capture(tiny_llama(device="meta"))
    for name, region in g.regions.items():
        nodes = dict(region.graph.nodes(data=True))
        assert nodes, f"{name}: empty graph"
        orders = []
        for n, a in nodes.items():
            assert {"op", "phase", "order", "out_bytes", "in_bytes", "flops", "block"} <= set(a), (name, n, a)
            # ATen overloads, plus `getitem` picking one output of a multi-output op
            assert isinstance(a["op"], str) and (a["op"].startswith("aten.") or "getitem" in a["op"]), \
                (name, n, a["op"])
            assert a["phase"] in ("fwd", "bwd"), (name, n, a["phase"])
            assert (a["order"] <= region.boundary) == (a["phase"] == "fwd"), \
                (name, n, a["order"], region.boundary)
            assert 0 <= a["order"] < region.n_nodes, (name, n, a["order"], region.n_nodes)
            assert _is_poly(a["out_bytes"]) and _is_poly(a["flops"]), (name, n, a["out_bytes"], a["flops"])
            assert a["block"] == (0 if name == "block0" else None), (name, n, a["block"])
            orders.append(a["order"])
        assert len(set(orders)) == len(orders), f"{name}: execution orders repeat"
        for u, v in region.graph.edges:  # data flows forward in execution order
            assert nodes[u]["order"] < nodes[v]["order"], (name, u, v)
        assert region.fwd_nodes() and region.bwd_nodes(), name
    ops = {a["op"] for _, a in g.regions["block0"].graph.nodes(data=True)}
    assert "aten.mm.default" in ops
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in ops
    assert "aten._scaled_dot_product_flash_attention_for_cpu_backward.default" in ops


def test_sizes_are_polynomials_in_b_and_s(tiny_llama):
    h, v = 64, 512
    g = capture(tiny_llama(device="meta"))
    head = g.regions["head"].graph.nodes
    emb = [a for _, a in head(data=True) if a["op"] == "aten.embedding.default"]
    assert [a["out_bytes"] for a in emb] == [((1, 1, 4.0 * h),)]  # (b, s, h) fp32
    tail = g.regions["tail"].graph.nodes
    logits = [a for _, a in tail(data=True) if a["op"] == "aten.mm.default" and a["phase"] == "fwd"]
    assert [a["out_bytes"] for a in logits] == [((1, 1, 4.0 * v),)]  # (b*s, V) fp32
    assert [a["flops"] for a in logits] == [((1, 1, 2.0 * h * v),)]  # 2 * (b*s) * h * V
    attn = [a for _, a in g.regions["block0"].graph.nodes(data=True)
            if a["op"] == "aten._scaled_dot_product_flash_attention_for_cpu.default"]
    assert len(attn) == 1 and {(i, j) for i, j, _ in attn[0]["flops"]} == {(1, 2)}, attn  # b * s^2


# ---------------------------------------------------------------- FLOPs against FlopCounterMode


@pytest.mark.parametrize("overrides, b, s", [
    ({}, 2, 48),
    ({}, 3, 17),
    ({"intermediate_size": 113}, 2, 48),   # collides with the first sentinel sequence length
    ({"num_key_value_heads": 4}, 1, 64),   # no GQA
])
def test_flops_equal_flop_counter_mode(tiny_llama, one_thread, overrides, b, s):
    model = tiny_llama(**overrides)
    g = capture(model)
    x = torch.randint(0, 512, (b, s), generator=torch.Generator().manual_seed(0))
    y = torch.roll(x, -1, dims=1)
    fwd = FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOP_FORMULAS)
    with fwd:
        loss = lm_loss(model(input_ids=x).logits, y)
    bwd = FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOP_FORMULAS)
    with bwd:
        loss.backward()
    measured = {"fwd": fwd.get_total_flops(), "bwd": bwd.get_total_flops()}
    for phase in ("fwd", "bwd"):
        predicted = _predicted_flops(g, b, s, phase)
        assert predicted == measured[phase], (
            f"{phase} FLOPs at b={b}, s={s}: predicted {predicted:.0f}, FlopCounterMode {measured[phase]}")
    total = _predicted_flops(g, b, s)
    assert total == measured["fwd"] + measured["bwd"], (total, measured)


# ---------------------------------------------------------------- storage categories


@pytest.mark.parametrize("b, s", [(1, 1), (2, 48)])
def test_param_grad_bytes_are_the_parameter_bytes(tiny_llama, b, s):
    g = capture(tiny_llama(device="meta"))
    for name, region in g.regions.items():
        got, want = region.param_grad_bytes(b, s), region.param_bytes()
        assert got == want, f"{name} at b={b}, s={s}: param_grad_bytes {got}, parameter bytes {want}"


# ---------------------------------------------------------------- what is not a causal LM


def _gpt2():
    cfg = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=128, n_positions=64)
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(cfg)


def _llama_base():
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, vocab_size=128)
    with torch.device("meta"):
        return transformers.LlamaModel(cfg)  # the decoder without its LM head


@pytest.mark.parametrize("make, match", [
    (lambda: nn.Linear(4, 4), "cannot capture Linear: it has no nn.ModuleList of blocks"),
    (lambda: nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8)), "cannot capture Sequential: it has no nn.ModuleList"),
    (_llama_base, "LlamaModel.*BaseModelOutputWithPast.*no logits.*without its LM head"),
])
def test_not_a_causal_lm_is_an_error(make, match):
    with pytest.raises(TrainplanError, match=match):
        capture(make())


def test_gpt2_layout_captures():
    g = capture(_gpt2())
    assert g.blocks == ("block0",) * g.n_layers and g.n_layers >= 1
    assert g.hidden_size == 32 and g.n_heads == 2
