"""The joint solve's polish: at the token level, data fraction and widths the joint CP-SAT model
chose, the combo and blocks per checkpoint entry with the cheapest tokens, solved exactly, one
small CP-SAT model per combo (`trainplan.planner.joint.solver.solve_joint` calls `cheapest_tokens`).

Why per combo: in one model over all combos, each combo's cost and memory rows hold only under
its own literal (reified linear constraints), whose LP relaxation is weak; with 20 combos of
llama3-70b on 8 x mi300 that model stopped at its 0.5 s deterministic limit unproven (bound 6%
under the incumbent, 1.2-3 s of wall time each). Per combo the rows are plain and each model
proves optimal in 0.02-0.1 deterministic s; combos are solved in order of a lower bound on their
cost (the LP relaxation of the rows always in force) until the bound passes the best found:
branch and bound over combos. Measured (`python benchmarks/solve_speed.py --quick`): the whole
llama3-70b solve at 128K on 8 x mi300 went from 8.6 to 4.4 s, its polish from 3.9-4.6 s to 0.2 s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ortools.sat.python import cp_model
from scipy.optimize import linprog

from trainplan.costmodels.loss.law import LossLaw
from trainplan.costmodels.loss.planned import run_loss
from trainplan.planner.budget import Budget
from trainplan.planner.joint.combos import BYTES_PER_UNIT, Combo, memory_rows, units
from trainplan.planner.joint.search import budget_cap, budget_terms, spent

CostUnits = tuple[int, Mapping[str, int]]
"""A combo's cost per token in the polish's integer units: (fixed units, units per block on
each entry)."""


Spent = tuple[tuple[float, int], Combo, Mapping[str, int], float]
"""((predicted loss in nats, optimizer steps), combo, blocks per entry, data fraction) of a plan
that spends the whole budget."""


@dataclass(frozen=True, slots=True)
class Polished:
    """The cheapest tokens found: combo index, blocks per entry, (cost, tie-break cost) units."""

    index: int
    counts: dict[str, int]
    cost: tuple[int, int]


def cheapest_tokens(combos: Sequence[Combo], members: Sequence[int], entries: Sequence[str], L: int,
                    mem_cap: int, level: int,
                    terms: Callable[[Combo], tuple[dict[str, float], float, float, float]],
                    cost: Sequence[CostUnits], tie: Sequence[CostUnits] | None,
                    configure: Callable[[cp_model.CpSolver], None]) -> Polished | None:
    """Of `combos[i]` for i in `members`, the combo and blocks per entry (summing to L, entries
    off a combo's menu at 0) that fit memory (`memory_rows` <= `mem_cap`, in `BYTES_PER_UNIT`
    units) and the budget at `level` tokens (`terms`: the compute constraint's, as
    `trainplan.planner.joint.search.budget_terms` gives them) with the least `cost` units per token, ties
    to the least `tie` units (None: no tie-break); None when none fits.

    Exact: each combo is one CP-SAT model run by `configure` (deterministic time limit, seed,
    one worker); combos whose bound (`_lp_bound`) is above the best found are not solved.
    Combos are tried in order of bound, then index (deterministic)."""
    def bound(i: int) -> float:
        return _lp_bound(combos[i], L, mem_cap, level, terms(combos[i]), cost[i])

    best: Polished | None = None
    for i in sorted(members, key=lambda i: (bound(i), i)):
        if best is not None and bound(i) > best.cost[0]:
            break
        got = _solve_combo(combos[i], entries, L, mem_cap, level, terms(combos[i]), cost[i],
                           None if tie is None else tie[i], configure)
        if got is not None and (best is None or got[0] < best.cost):
            best = Polished(index=i, counts=got[1], cost=got[0])
    return best


def _lp_bound(c: Combo, L: int, mem_cap: int, level: int, terms: tuple[dict[str, float], float, float, float],
              cost: CostUnits) -> float:
    """A lower bound on combo c's cost units: the LP relaxation (blocks per entry continuous) of
    its problem with only the rows always in force, the tail's memory (`memory_rows`' first) and
    the budget; inf when even that is infeasible. scipy's HiGHS."""
    menu = list(c.menu)
    R = [units(c.cost_of(e).retained_bytes, BYTES_PER_UNIT) for e in menu]
    fixed_mem = units(c.memory.base_bytes, BYTES_PER_UNIT) + units(c.memory.tail_bytes, BYTES_PER_UNIT)
    per_step, fixed_cost, cap, scale = terms
    steps = math.ceil(level / c.tokens_per_step)
    B = [units(steps * per_step[e], scale) for e in menu]
    res = linprog([cost[1][e] for e in menu], A_ub=[R, B],
                  b_ub=[mem_cap - fixed_mem, int(cap / scale) - units(steps * fixed_cost, scale)],
                  A_eq=[[1] * len(menu)], b_eq=[L], bounds=[(0, L)] * len(menu), method="highs")
    # less a relative 1e-6: HiGHS's optimum is a float within its tolerances; the bound stays below
    return cost[0] + res.fun - 1e-6 * abs(res.fun) if res.status == 0 else math.inf


def _solve_combo(c: Combo, entries: Sequence[str], L: int, mem_cap: int, level: int,
                 terms: tuple[dict[str, float], float, float, float], cost: CostUnits, tie: CostUnits | None,
                 configure: Callable[[cp_model.CpSolver], None]) -> tuple[tuple[int, int], dict[str, int]] | None:
    """((cost, tie) units, blocks per entry) of combo c's cheapest feasible assignment, or None."""
    m = cp_model.CpModel()
    menu = [e for e in entries if e in c.menu]
    n = {e: m.new_int_var(0, L, f"blocks_{e}") for e in menu}
    u = {e: m.new_bool_var(f"uses_{e}") for e in menu}
    m.add(sum(n.values()) == L)
    for e in menu:
        m.add(n[e] >= u[e])
        m.add(n[e] <= L * u[e])
    order = sorted(menu, key=lambda e: c.cost_of(e).retained_bytes)
    for _, row_entry, row in memory_rows(c, order, n, lambda v: units(v, BYTES_PER_UNIT)):
        if row_entry is None:
            m.add(row <= mem_cap)
        else:
            m.add(row <= mem_cap).only_enforce_if(u[row_entry])
    per_step, fixed_cost, cap, scale = terms
    steps = math.ceil(level / c.tokens_per_step)
    m.add(sum(n[e] * units(steps * per_step[e], scale) for e in menu)
          + units(steps * fixed_cost, scale) <= int(cap / scale))
    primary = cost[0] + sum(n[e] * cost[1][e] for e in menu)
    if tie is None:
        m.minimize(primary)
    else:
        secondary = tie[0] + sum(n[e] * tie[1][e] for e in menu)
        m.minimize(primary * (tie[0] + L * max(tie[1][e] for e in menu) + 1) + secondary)
    solver = cp_model.CpSolver()
    configure(solver)
    # the LP with the reified rows' linearization: measured on a llama3.1-405b combo on 1024 x
    # mi300 (16 entries, L = 126), OPTIMAL in 0.09 deterministic s; at the default level 1 the
    # bound stalled 1.2% under the optimum for 5 s
    solver.parameters.linearization_level = 2
    if solver.solve(m) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    counts = {e: int(solver.value(n[e])) if e in n else 0 for e in entries}
    got_cost = cost[0] + sum(counts[e] * cost[1][e] for e in menu)
    got_tie = 0 if tie is None else tie[0] + sum(counts[e] * tie[1][e] for e in menu)
    return (got_cost, got_tie), counts


def best_spent(combos: Sequence[Combo], entries: Sequence[str], L: int, mem_cap: int, wall: float | None,
                budget: Budget, devices: int, law: LossLaw, n_params: int, data_tokens: int,
                fractions: Sequence[float], bits_pen: Mapping[tuple[int, int], float],
                incumbent: Spent, cost_units: Sequence[CostUnits], tie_units: Sequence[CostUnits] | None,
                configure: Callable[[cp_model.CpSolver], None]) -> Spent:
    """The plan of least spent loss (`spent`: the whole budget at the knobs, nats) over every
    (global batch, group of widths of equal loss penalty): per group the cheapest tokens that
    fit memory and one step of the budget (`cheapest_tokens`, exact), scored at each data
    fraction. A group whose loss at the most tokens its fastest combo could buy (its menu's
    cheapest entry on every block, memory ignored) is no better than the incumbent is not
    solved. Ties keep the incumbent, but for the polished plan of its own group (the same loss
    at cheaper tokens). Returns ((loss, steps), combo, blocks per entry, fraction)."""
    cap = budget_cap(budget, wall)
    best = incumbent
    own = (incumbent[1].tokens_per_step, bits_pen[incumbent[1].bits])
    groups: dict[tuple[int, float], list[int]] = {}
    for i, c2 in enumerate(combos):
        groups.setdefault((c2.tokens_per_step, bits_pen[c2.bits]), []).append(i)

    def fastest(c2: Combo) -> float:  # one step with every block on its cheapest entry
        if wall is not None:
            return c2.fixed_s + L * min(x.block_s for x in c2.menu.values())
        return min(x.step_flops for x in c2.menu.values()) * devices

    def floor(key: tuple[int, float]) -> float:
        g, pen = key
        steps_ub = max(1.0, cap / min(fastest(combos[i]) for i in groups[key]))
        return pen + min(run_loss(law, n_params, steps=steps_ub, tokens_per_step=g,
                                  unique_tokens=max(1.0, fr * data_tokens)) for fr in fractions)

    floors = {key: floor(key) for key in groups}
    for key in sorted(groups, key=lambda key: (floors[key], key)):
        if floors[key] >= best[0][0]:
            break
        polished = cheapest_tokens(combos, groups[key], entries, L, mem_cap, key[0],
                                   lambda c2: budget_terms(c2, entries, L, wall, budget, devices),
                                   cost_units, tie_units, configure)
        if polished is None:
            continue
        c2, counts2 = combos[polished.index], polished.counts
        for fr in fractions:
            got = spent(c2, counts2, L, wall, budget, devices, law, n_params, fr, data_tokens, key[0], bits_pen)
            if got[0] < best[0][0] or (key == own and fr == incumbent[3] and got[0] <= incumbent[0][0]):
                best = (got, c2, counts2, fr)
    return best
