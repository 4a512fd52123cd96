"""Per-block rematerialization: node keys against the run-time op stream, the linear lifetime
model against the replay, the CP-SAT model's binding, slack and infeasible cases, the optimizer
against every baseline, a monotonicity property, sequence-awareness, and a tiny model whose
measured saved bytes and recompute FLOPs equal the predicted ones (STYLE 10, 11)."""

from __future__ import annotations

import math
import random
from functools import partial

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from trainplan.costmodels.checkpoint_sets import (
    BUILTIN,
    CheckpointSet,
    KeyCounter,
    keys_of,
    node_keys,
    resolve,
    sets_from_mapping,
)
from trainplan.costmodels.step.memory import simulate_region
from trainplan.costmodels.step.model import Choice
from trainplan.costmodels.step.remat_cost import BlockCase, evaluate
from trainplan.costmodels.step.roofline import region_cost
from trainplan.errors import PlanMismatchError, TrainplanError
from trainplan.executor.apply.checkpointing import apply_checkpointing, sac_forward
from trainplan.hardware_profiles import load
from trainplan.modeling.flop_counting import CPU_ATTENTION_FLOP_FORMULAS
from trainplan.planner.capture.graph import capture
from trainplan.planner.joint.remat_solver import BlockModel, linear_memory, pareto_menu, solve_block
from trainplan.planner.joint.remat_strategies import BASELINES, STRATEGIES, optimal

SHAPES = [(1, 16), (2, 64), (1, 1024), (4, 4096)]
FRACTIONS = [0.0, 0.02, 0.1, 0.3, 0.6, 1.0]


@pytest.fixture(scope="module")
def region(tiny_llama):
    return capture(tiny_llama(device="meta")).regions["block0"]


def _case(region, b, s, hw="h100", stack=2, dtype="bf16") -> BlockCase:
    return BlockCase(region=region, b=b, s=s, sp=1, hw=load(hw), dtype=dtype, stack=stack)


def _span(case) -> tuple[float, float]:
    """(full checkpointing's stacked peak, no checkpointing's)."""
    return evaluate(case, BUILTIN["full"]).peak_bytes, evaluate(case, BUILTIN["none"]).peak_bytes


def _recompute(case, entry) -> float:
    return evaluate(case, entry).recompute_s


# ---------------------------------------------------------------- which graph


def test_node_keys_match_the_runtime_op_stream(tiny_llama, region):
    """The SAC policy function sees the captured forward's ops, in order, detach and getitem
    left out; `KeyCounter` names each call as `node_keys` names its node."""
    model = tiny_llama()
    seen: list[str] = []
    counter = KeyCounter()

    def policy_fn(ctx, op, *a, **kw):
        from torch.utils.checkpoint import CheckpointPolicy

        seen.append(counter.key(str(op)))
        return CheckpointPolicy.PREFER_RECOMPUTE

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    layer = model.model.layers[0]
    orig = layer.forward
    layer.forward = lambda *a, **k: checkpoint(
        orig, *a, use_reentrant=False, context_fn=partial(create_selective_checkpoint_contexts, policy_fn), **k)
    model(input_ids=torch.randint(0, 512, (2, 16))).logits.sum().backward()
    traced = list(node_keys(region).values())
    first = next((i for i, (a, b) in enumerate(zip(seen, traced, strict=False)) if a != b),
                 min(len(seen), len(traced)))
    assert seen == traced, f"run time {len(seen)} ops, traced {len(traced)}: first difference at {first}"


def test_attention_overloads_share_one_key():
    cpu = CheckpointSet(name="x", saved=frozenset({"aten._scaled_dot_product_flash_attention_for_cpu.default"}))
    assert cpu.saves("attention#0") and cpu.saves("attention#3")
    k = KeyCounter()
    assert k.key("aten._scaled_dot_product_efficient_attention.default") == "attention#0"


# ---------------------------------------------------------------- the linear model is the replay


@pytest.mark.parametrize("b, s", SHAPES)
def test_linear_memory_equals_the_lifetime_replay(region, b, s):
    case = _case(region, b, s)
    lm = linear_memory(case)
    rng = random.Random(b * 10007 + s)
    for _ in range(40):
        x = np.array([rng.random() < 0.5 for _ in lm.candidates], dtype=float)
        saved = [v for v, on in zip(lm.candidates, x, strict=False) if on]
        mem = simulate_region(region, b, s, checkpoint=True, saved_ops=saved)
        got = lm.peaks(x)
        want = (mem.retained, mem.fwd_peak.total, mem.bwd_peak.total)
        assert all(math.isclose(g, w, rel_tol=1e-12) for g, w in zip(got, want, strict=False)), (saved, got, want)


# ---------------------------------------------------------------- binding, slack, infeasible


def test_slack_cap_keeps_everything_worth_keeping(region):
    case = _case(region, 2, 64)
    lm = linear_memory(case)
    everything = CheckpointSet(name="all", saved=keys_of(region, lm.candidates))
    sol = solve_block(case, evaluate(case, everything).peak_bytes)
    assert sol.status == "OPTIMAL", sol
    got = _recompute(case, CheckpointSet(name="x", saved=keys_of(region, sol.saved)))
    assert math.isclose(got, lm.fixed_recompute_s, rel_tol=1e-9), (got, lm.fixed_recompute_s)


@pytest.mark.parametrize("b, s", SHAPES)
def test_binding_cap_is_met_and_costs_recompute(region, b, s):
    case = _case(region, b, s)
    lo, hi = _span(case)
    cap = lo + 0.3 * (hi - lo)
    sol = solve_block(case, cap)
    entry = CheckpointSet(name="x", saved=keys_of(region, sol.saved))
    cost = evaluate(case, entry)
    assert cost.peak_bytes <= cap, f"stacked peak {cost.peak_bytes:.0f} B over the cap {cap:.0f} B"
    slack = solve_block(case, hi)
    assert cost.recompute_s > _recompute(case, CheckpointSet(name="y", saved=keys_of(region, slack.saved))), \
        "a binding cap should cost recompute against a slack one"


@pytest.mark.parametrize("cap_of_full", [0.0, 0.5, 0.999])
def test_below_full_checkpointing_is_infeasible(region, cap_of_full):
    case = _case(region, 2, 64)
    cap = cap_of_full * _span(case)[0]
    assert solve_block(case, cap).status == "INFEASIBLE"
    assert optimal(case, cap) is None
    assert all(STRATEGIES[b](case, cap) is None for b in BASELINES), "a baseline fit below full checkpointing"


# ---------------------------------------------------------------- never worse than a baseline


@pytest.fixture(scope="module")
def cases(region):
    from trainplan.planner.capture.setup import capture_model

    big = capture_model("llama3-8b", "bf16-mixed")[0].regions["block0"]
    out = [_case(region, b, s, "h100") for b, s in SHAPES if s != 1024] + [_case(region, 1, 1024, "cpu")]
    return out + [BlockCase(region=big, b=1, s=s, sp=1, hw=load("mi300"), dtype="bf16", stack=32)
                  for s in (2048, 32768)]


def test_optimizer_is_never_worse_than_any_baseline(cases):
    for case in cases:
        lo, hi = _span(case)
        for f in (0.0, 0.05, 0.2, 0.5):
            cap = lo + f * (hi - lo)
            best = optimal(case, cap)
            assert best is not None, (case.b, case.s, f)
            mine = evaluate(case, best)
            assert mine.peak_bytes <= cap, (case.b, case.s, f, mine.peak_bytes, cap)
            for name in BASELINES:
                other = STRATEGIES[name](case, cap)
                if other is None:
                    continue
                theirs = _recompute(case, other)
                assert mine.recompute_s <= theirs * (1 + 1e-9), (
                    f"{case.region.name} b={case.b} s={case.s} cap at {f:.0%}: optimal recomputes "
                    f"{mine.recompute_s:.3e} s, {name} {theirs:.3e} s")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(b=st.integers(1, 4), s=st.integers(8, 4096), f1=st.floats(0, 1), f2=st.floats(0, 1),
       stack=st.integers(1, 8))
def test_more_memory_never_means_more_recompute(region, b, s, f1, f2, stack):
    case = _case(region, b, s, stack=stack)
    lo, hi = _span(case)
    small, large = sorted((f1, f2))
    r_small = _recompute(case, optimal(case, lo + small * (hi - lo)))
    r_large = _recompute(case, optimal(case, lo + large * (hi - lo)))
    assert r_large <= r_small * (1 + 1e-9), (b, s, small, large, r_small, r_large)


# ---------------------------------------------------------------- menus


@pytest.mark.parametrize("b, s", SHAPES)
def test_menu_is_a_pareto_front_with_none_and_full(region, b, s):
    menu = pareto_menu(_case(region, b, s))
    names = [e.entry.name for e in menu.entries]
    assert names[0] == "none" and names[-1] == "full", names
    peaks = [e.cost.peak_bytes for e in menu.entries]
    recs = [e.cost.recompute_s for e in menu.entries]
    assert peaks == sorted(peaks, reverse=True) and recs == sorted(recs), (names, peaks, recs)
    assert len(set(names)) == len(names)


def test_sequence_decides_what_is_kept():
    """At AutoSP's memory, a Llama-3-8B block keeps attention at long sequence and projections
    at short sequence: from the cost model, not from a rule."""
    from trainplan.planner.capture.setup import capture_model

    r = capture_model("llama3-8b", "bf16-mixed")[0].regions["block0"]
    kept = {}
    for s in (512, 32768):
        case = BlockCase(region=r, b=1, s=s, sp=1, hw=load("h100"), dtype="bf16", stack=32)
        sol = solve_block(case, evaluate(case, BUILTIN["save_attention"]).peak_bytes)
        kept[s] = keys_of(r, sol.saved)
    assert "attention#0" in kept[32768], kept[32768]
    assert "attention#0" not in kept[512] and any(k.startswith("aten.mm") for k in kept[512]), kept[512]


def test_block_solve_of_a_70b_block_is_optimal(region):
    """The per-block model of llama3-70b's block at 16K tokens over SP 8 is solved to
    optimality. Its time limit is wall-clock seconds, so the test gives it 60 (a loaded machine
    must not end the search early); how long it takes is a benchmark figure, `block_solve_s` in
    benchmarks/solve_speed.py (was asserted here under 2 s)."""
    from trainplan.planner.capture.setup import capture_model

    r = capture_model("llama3-70b", "bf16-mixed")[0].regions["block0"]
    case = BlockCase(region=r, b=1, s=16384, sp=8, hw=load("mi300"), dtype="bf16", stack=80)
    bm = BlockModel(case)
    lo, hi = _span(case)
    sol = bm.solve(lo + 0.1 * (hi - lo), time_limit_s=60.0)
    assert sol.status == "OPTIMAL", sol


# ---------------------------------------------------------------- measured against predicted


def _block_inputs(model, b, s):
    torch.manual_seed(0)
    x = torch.randn(b, s, model.config.hidden_size, requires_grad=True)
    pos = torch.arange(s)[None]
    cos, sin = model.model.rotary_emb(x, pos)
    return x, dict(position_embeddings=(cos, sin), position_ids=pos, attention_mask=None)


def _measured_retained(layer, entry, x, kw) -> int:
    """Bytes of tensor storages alive between a checkpointed block's forward and backward:
    those its forward made and still holds, plus its input (kept by the checkpoint)."""
    before = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    before |= {t.untyped_storage().data_ptr() for t in kw["position_embeddings"]}
    made: list = []

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in before:
                    made.append((StorageWeakRef(t.untyped_storage()), t.untyped_storage().data_ptr(),
                                 t.untyped_storage().nbytes()))
            return out

    with Track():
        out = sac_forward(layer.forward, entry, x, **kw)
    out = out[0] if isinstance(out, tuple) else out
    alive = {ptr: n for ref, ptr, n in made if not ref.expired()}
    alive.pop(out.untyped_storage().data_ptr(), None)
    out.sum().backward()
    return sum(alive.values()) + x.untyped_storage().nbytes()


@pytest.fixture(scope="module")
def solved_sets(region):
    case = _case(region, 2, 64, dtype="fp32")
    lo, hi = _span(case)
    sets = [BUILTIN["full"], BUILTIN["save_attention"], BUILTIN["save_matmuls"]]
    for i, f in enumerate((0.1, 0.4, 0.8)):
        sol = solve_block(case, lo + f * (hi - lo))
        sets.append(CheckpointSet(name=f"remat:{i + 1}", saved=keys_of(region, sol.saved)))
    return case, sets


def test_measured_saved_bytes_equal_predicted(tiny_llama, solved_sets):
    case, sets = solved_sets
    model = tiny_llama()
    for entry in sets:
        x, kw = _block_inputs(model, case.b, case.s)
        got = _measured_retained(model.model.layers[0], entry, x, kw)
        want = evaluate(case, entry).retained_bytes
        assert got == want, f"{entry.name}: measured {got} B kept for backward, predicted {want:.0f} B"


def test_measured_recompute_flops_equal_predicted(tiny_llama, solved_sets, cpu_profile):
    from torch.utils.flop_counter import FlopCounterMode

    case, sets = solved_sets
    model = tiny_llama()
    layer = model.model.layers[0]
    for entry in sets + [BUILTIN["none"]]:
        x, kw = _block_inputs(model, case.b, case.s)
        fc = FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOP_FORMULAS)
        with fc:
            out = sac_forward(layer.forward, entry, x, **kw) if entry.checkpointed else layer(x, **kw)
            out = out[0] if isinstance(out, tuple) else out
            out.backward(torch.ones_like(out))
        cost = region_cost(case.region, case.b, case.s, 1, entry, cpu_profile, "fp32")
        want = cost.fwd_flops + cost.bwd_flops + cost.recompute_flops
        got = fc.get_total_flops()
        assert math.isclose(got, want, rel_tol=1e-9), f"{entry.name}: measured {got} FLOPs, predicted {want:.0f}"


# ---------------------------------------------------------------- plans carry their sets


def test_plan_names_solved_entries_and_the_executor_rebuilds_them(tiny_llama):
    from trainplan.planner.api import plan_for_choice, solve
    from trainplan.planner.budget import Budget
    from trainplan.planner.plan import Plan

    kw = dict(seq_len=512, vocab_size=512)
    peak = {e: plan_for_choice("tiny-llama", "cpu", micro_batch=1, activation_checkpoint=e, **kw)
            .predictions.memory_bytes["total"] for e in ("none", "full")}
    cap = peak["full"] + 0.3 * (peak["none"] - peak["full"])
    plan = solve("tiny-llama", "cpu", Budget(wall_clock_s=600), micro_batches=(1,), optimizer_bits=(32,),
                 data_fractions=(1.0,), memory_limit_bytes=cap, **kw)
    d = plan.decisions
    assert plan.predictions.memory_bytes["total"] <= cap
    assert any(e.startswith("remat:") for e in d.activation_checkpoint), d.activation_checkpoint
    assert set(d.checkpoint_sets) == {e for e in d.activation_checkpoint if e.startswith("remat:")}
    back = Plan.from_json(plan.to_json())
    assert back == plan and back.decisions.checkpoint_sets == d.checkpoint_sets
    # the same plan without the menu predicts no lower loss
    named = solve("tiny-llama", "cpu", Budget(wall_clock_s=600), micro_batches=(1,), optimizer_bits=(32,),
                  data_fractions=(1.0,), memory_limit_bytes=cap,
                  policies=("none", "save_matmuls", "save_attention", "full"), **kw)
    assert plan.predictions.final_loss <= named.predictions.final_loss + 1e-12
    # predictions recomputed from the plan's decisions alone agree
    fixed = plan_for_choice("tiny-llama", "cpu", micro_batch=1, activation_checkpoint=d.activation_checkpoint,
                            checkpoint_sets=d.checkpoint_sets, **kw)
    assert fixed.predictions.memory_bytes == plan.predictions.memory_bytes
    assert Choice.from_decisions(d).sets and all(resolve(e, sets_from_mapping(d.checkpoint_sets))
                                                 for e in d.activation_checkpoint)
    model = tiny_llama(num_hidden_layers=4)
    apply_checkpointing(model, d.activation_checkpoint, d.checkpoint_sets)
    with pytest.raises(PlanMismatchError, match="remat:"):
        apply_checkpointing(tiny_llama(num_hidden_layers=4), d.activation_checkpoint)


def test_unknown_policy_is_a_typed_error():
    with pytest.raises(TrainplanError, match="known policies are none, full"):
        resolve("remat:7")
