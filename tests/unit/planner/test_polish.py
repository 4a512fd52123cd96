"""trainplan.planner.joint.polish: the cheapest tokens per combo, solved exactly, against brute force over
every assignment of tiny-llama's 4 blocks to the built-in checkpoint entries, at memory caps from
binding every combo to binding none, under a time and a FLOP budget."""

from __future__ import annotations

import itertools
import math

import pytest

from trainplan.costmodels.checkpoint_sets import resolve
from trainplan.costmodels.step.model import Choice
from trainplan.planner.budget import Budget
from trainplan.planner.joint.combos import BYTES_PER_UNIT, combo_memory, make_combo, memory_rows, units
from trainplan.planner.joint.polish import cheapest_tokens
from trainplan.planner.joint.search import budget_terms

ENTRIES = ["none", "save_matmuls", "save_attention", "full"]
SEQ = 2048


@pytest.fixture(scope="module")
def combos(problems):
    pr = problems["tiny-llama"]  # at SEQ tokens
    sm, space = pr.step_model, pr.space(2)
    out = []
    for sp, mb in itertools.product((1, 2), (1, 4)):
        base = Choice(sp_degree=sp, zero_stage=0, micro_batch=mb, seq_len=SEQ, policies=("none",) * 4,
                      precision=space.precision, optimizer_bits=space.optimizer_bits[0], devices=2,
                      activation_bits=space.activation_bits[0])
        out.append(make_combo(sm, base, {e: resolve(e) for e in ENTRIES}, combo_memory(sm, base)))
    return out


def _brute(combos, L, mem_cap, level, terms, cost, tie):
    best = None
    for i, c in enumerate(combos):
        per_step, fixed_cost, cap, scale = terms(c)
        steps = math.ceil(level / c.tokens_per_step)
        for split in itertools.product(range(L + 1), repeat=len(ENTRIES)):
            if sum(split) != L:
                continue
            n = dict(zip(ENTRIES, split, strict=True))
            order = sorted(ENTRIES, key=lambda e, c=c: c.cost_of(e).retained_bytes)
            rows = memory_rows(c, order, n, lambda v: units(v, BYTES_PER_UNIT))
            if any(v > mem_cap for _, e, v in rows if e is None or n[e] > 0):
                continue
            if sum(n[e] * units(steps * per_step[e], scale) for e in ENTRIES) \
                    + units(steps * fixed_cost, scale) > int(cap / scale):
                continue
            got = (cost[i][0] + sum(n[e] * cost[i][1][e] for e in ENTRIES),
                   0 if tie is None else tie[i][0] + sum(n[e] * tie[i][1][e] for e in ENTRIES))
            if best is None or got < best:
                best = got
    return best


@pytest.mark.parametrize("kind", ["time", "flops"])
def test_cheapest_tokens_is_the_brute_force_optimum(combos, kind):
    L = 4
    budget = Budget(devices=2, device_hours=1.0) if kind == "time" else Budget(devices=2, flops=1e17)
    wall = budget.wall_s_for(2)
    cost = [(units(c.fixed_s, 1e-9), {e: units(c.cost_of(e).block_s, 1e-9) for e in ENTRIES}) for c in combos]
    tie = None if kind == "time" else [
        (0, {e: units(c.cost_of(e).step_flops / L, 1e3) for e in ENTRIES}) for c in combos]

    def terms(c):
        return budget_terms(c, ENTRIES, L, wall, budget, 2)

    def configure(s):
        s.parameters.num_workers, s.parameters.random_seed = 1, 0

    q = lambda v: units(v, BYTES_PER_UNIT)  # noqa: E731
    peaks = sorted(max(v for _, _, v in memory_rows(c, [e], {e: L}, q)) for c in combos for e in ENTRIES)
    binding = 0
    for mem_cap in [peaks[0] - 1, *peaks, (peaks[0] + peaks[-1]) // 2]:
        want = _brute(combos, L, mem_cap, SEQ, terms, cost, tie)
        got = cheapest_tokens(combos, range(len(combos)), ENTRIES, L, mem_cap, SEQ, terms, cost, tie, configure)
        assert (got is None) == (want is None), (mem_cap, got, want)
        if got is not None:
            assert got.cost == want, (mem_cap, got, want)
            binding += got.counts != {"none": L, "save_matmuls": 0, "save_attention": 0, "full": 0}
    assert binding >= 2, "no cap made the cheapest assignment checkpoint"
