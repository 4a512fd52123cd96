"""`trainplan.costmodels.step.ulysses` against MemTracker: one transformer block run by the executor's Ulysses
attention in one process, the all-to-all replaced by a copy (same shapes and buffers, so the
same storages; the data is not what P ranks would exchange, which memory does not see).

Compared: the block's forward peak, what it keeps after its forward, and its backward peak, as
MemTracker's per-module snapshots show them, minus the same at SP degree 1 (plain SDPA, the
captured graph), against the same difference predicted by `simulate_region` with and without
`ulysses_block_events`. The difference isolates what Ulysses adds; the config's MLP is wide
enough that the single-process peaks fall where the single-process replay puts them.
"""

from __future__ import annotations

import importlib.util
import weakref
from collections import Counter
from functools import partial
from pathlib import Path

import pytest
import torch

from trainplan.costmodels.checkpoint_sets import resolve, saved_nodes
from trainplan.costmodels.graph import poly_at
from trainplan.costmodels.step.memory import simulate_region
from trainplan.costmodels.step.ulysses import kv_replication, ulysses_block_events

_spec = importlib.util.spec_from_file_location(
    "_parallel_worker", Path(__file__).with_name("_parallel_worker.py"))
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

SEQ = 64
"""Per-rank sequence length of the block run."""


def _config(kv_heads: int = 4):
    cfg = worker.mem_config()  # hidden 256, 8 heads, 4 kv heads, MLP 688
    cfg.num_hidden_layers, cfg.num_key_value_heads = 1, kv_heads
    return cfg


def _block(kv_heads: int = 4):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_config(kv_heads)).float().train()


def _graph(kv_heads: int = 4):
    from transformers import LlamaForCausalLM

    from trainplan.planner.capture.graph import capture

    with torch.device("meta"):
        model = LlamaForCausalLM(_config(kv_heads))
    return capture(model)


@pytest.fixture(scope="module")
def block():
    return _block()


@pytest.fixture(scope="module")
def graph():
    return _graph()


def _run_block(model, monkeypatch, sp: int, b: int, policy: str, mode) -> None:
    """Forward and backward of layer 0 at SP degree `sp` (simulated exchange) under `mode`."""
    import trainplan.executor.parallel.ulysses as par
    from trainplan.executor.apply.checkpointing import sac_forward

    layer = model.model.layers[0]
    layer.zero_grad(set_to_none=True)
    monkeypatch.setattr(par, "_SP_GROUP", object() if sp > 1 else None)
    monkeypatch.setattr(par, "_sp_size", lambda g: sp if g is not None else 1)
    monkeypatch.setattr(par.collectives, "all_to_all_single", lambda out, x, g: out.copy_(x))
    monkeypatch.setattr(model.config, "_attn_implementation", par.ULYSSES if sp > 1 else "sdpa")
    entry = resolve(policy)
    if entry.checkpointed:
        monkeypatch.setattr(layer, "forward", partial(sac_forward, layer.forward, entry))
    pos = torch.arange(SEQ)[None].expand(b, -1)
    cos, sin = model.model.rotary_emb(torch.empty(b, SEQ, 1), pos)
    with mode(cos, sin):
        x = torch.randn(b, SEQ, model.config.hidden_size, requires_grad=True)
        out = layer(x, position_embeddings=(cos, sin), position_ids=pos, attention_mask=None)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))


def _measure(model, monkeypatch, sp: int, b: int, policy: str) -> list[float]:
    """(forward peak, kept after forward, backward peak) of layer 0, bytes without parameters."""
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState

    mt = MemTracker()
    mt.track_external(model.model.layers[0])
    _run_block(model, monkeypatch, sp, b, policy, lambda cos, sin: mt)
    snaps = mt.memory_tracking[model.model.layers[0]].snapshots

    def total(state) -> float:
        snap = next(iter(snaps[state][0].values()))
        return float(sum(v for k, v in snap.items()
                         if str(k).split(".")[-1] not in ("Total", "PARAM", "BUFFER")))
    return [total(_ModState.PEAK_FW), total(_ModState.POST_FW), total(_ModState.PEAK_BW)]


def _predict(graph, sp: int, b: int, policy: str) -> list[float]:
    region = graph.regions["block0"]
    entry = resolve(policy)
    saved = saved_nodes(region, entry)
    extra = ulysses_block_events(region, b, SEQ, sp_degree=sp, n_heads=graph.n_heads,
                                 n_kv_heads=graph.n_kv_heads, checkpoint=entry.checkpointed,
                                 saved_ops=saved)
    end = region.n_nodes - 0.1  # the run above keeps its input and output to the end
    for r in region.storages:
        if r.is_fwd_output:
            extra.append((region.boundary + 0.01, end, poly_at(r.bytes, b, SEQ), "act"))
        if r.category == "input" and r.input_kind == "act":
            extra.append((r.last_use, end, poly_at(r.bytes, b, SEQ), "act"))
    m = simulate_region(region, b, SEQ, checkpoint=entry.checkpointed, saved_ops=saved, extra=extra)
    return [m.fwd_peak.total, m.retained, m.bwd_peak.total]


@pytest.mark.parametrize("policy", ["none", "full", "save_matmuls", "save_attention"])
@pytest.mark.parametrize("b", [1, 2])
def test_ulysses_block_memory_matches_memtracker(block, graph, monkeypatch, policy, b):
    """SP 2, 4 and 8 (8: kv heads repeated twice), micro-batch 1 and 2, each checkpoint kind."""
    def run(sp: int) -> tuple[list[float], list[float]]:
        with monkeypatch.context() as mp:
            return _measure(block, mp, sp, b, policy), _predict(graph, sp, b, policy)

    measured1, predicted1 = run(1)
    for sp in (2, 4, 8):
        measured, predicted = run(sp)
        got = [m - m1 for m, m1 in zip(measured, measured1, strict=False)]
        want = [p - p1 for p, p1 in zip(predicted, predicted1, strict=False)]
        assert got == want, (f"sp {sp}: MemTracker - SP 1 {got}, predicted {want} "
                             "(forward peak, kept, backward peak)")


def test_o_proj_input_is_the_block_s_extra_kept_tensor(graph):
    """Without checkpointing each block keeps one more tensor of attention-output size under
    Ulysses: o_proj's input, an all-to-all result's copy (single process: a view of attention's
    output)."""
    region = graph.regions["block0"]
    base = simulate_region(region, 1, SEQ)
    for sp in (2, 4):
        extra = ulysses_block_events(region, 1, SEQ, sp_degree=sp, n_heads=graph.n_heads,
                                     n_kv_heads=graph.n_kv_heads)
        got = simulate_region(region, 1, SEQ, extra=extra).retained - base.retained
        assert got == SEQ * graph.hidden_size * 4
    assert ulysses_block_events(region, 1, SEQ, sp_degree=1, n_heads=8, n_kv_heads=4) == []
    assert [kv_replication(4, p) for p in (1, 2, 4, 8, 16)] == [1, 1, 1, 2, 4]


def _allocations(model, monkeypatch, sp: int, b: int, policy: str) -> Counter:
    """Bytes of each storage the block's forward and backward allocate (parameters, rotary
    tables and storages already alive excluded)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    made: Counter = Counter()
    live: dict[int, weakref.ref] = {}

    class Allocations(TorchDispatchMode):
        def __init__(self, skip):
            super().__init__()
            self.skip = skip

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if not isinstance(t, torch.Tensor):
                    continue
                st = t.untyped_storage()
                key = st.data_ptr()
                if key in live or key in self.skip or not st.nbytes():
                    continue
                live[key] = weakref.ref(st, lambda _, k=key: live.pop(k, None))
                made[st.nbytes()] += 1
            return out

    def mode(cos, sin):
        keep = {p.untyped_storage().data_ptr() for p in model.parameters()}
        return Allocations(keep | {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()})

    model.model.layers[0].zero_grad(set_to_none=True)
    _run_block(model, monkeypatch, sp, b, policy, mode)
    return made


@pytest.mark.parametrize("policy", ["none", "full"])
@pytest.mark.parametrize(("kv_heads", "sps"), [(4, (2, 4)), (8, (8,))])
def test_ulysses_copies_and_buffers_are_the_modelled_ones(monkeypatch, policy, kv_heads, sps):
    """Every storage the exchanges add (send and receive buffers, reshape copies, o_proj's input,
    v's gradient copy; recomputed too under a checkpoint), by size and count, for micro-batch 1
    and 2 and 1, 2 or 4 heads per rank after the exchange (kv heads not repeated)."""
    model, graph = _block(kv_heads), _graph(kv_heads)
    entry = resolve(policy)
    region = graph.regions["block0"]
    for b in (1, 2):
        with monkeypatch.context() as mp:
            base = _allocations(model, mp, 1, b, policy)
        for sp in sps:
            assert kv_replication(kv_heads, sp) == 1
            with monkeypatch.context() as mp:
                got = _allocations(model, mp, sp, b, policy)
            events = ulysses_block_events(region, b, SEQ, sp_degree=sp, n_heads=graph.n_heads,
                                          n_kv_heads=graph.n_kv_heads, checkpoint=entry.checkpointed,
                                          saved_ops=saved_nodes(region, entry))
            want = Counter(int(n) for _, _, n, _ in events if n > 0)
            assert (got - base, base - got) == (want, Counter()), (sp, b)
