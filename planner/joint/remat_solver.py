"""Optimal checkpoint sets for one transformer block: a CP-SAT model over its forward+backward.

torch's selective activation checkpointing runs a fixed schedule: the block's forward in order,
then, at the start of its backward, one replay of the forward up to the last op whose output
backward reads (the early stop, `Region.recompute_horizon`), then the backward ops. The only
freedom is which forward outputs are saved. Given that schedule, every storage's lifetime is
fixed by one decision (is its creating op saved?), so the live bytes at every moment of the
block's forward, recompute and backward are linear in the save decisions: Checkmate's R/S model
(Jain et al. 2020) with the recompute matrix R fixed by torch's replay, and the memory at each
schedule step written out exactly as `trainplan.costmodels.step.memory.simulate_region` replays it (a storage
lives from the op that makes it to the last op that reads it; saved outputs stay in the
checkpoint's cache until the replay passes them or backward frees them).

The model, per block shape (micro-batch b, per-rank sequence s):

- `save_v` (bool): forward op v keeps its output (v makes a storage and runs before the early stop);
- [Constraint] for every allocation moment t: (stack - 1) * retained + live_t <= cap, where
  `retained` is what the block holds between its forward and backward and `stack` the number of
  identical blocks whose retained bytes add up below it: the block's real contribution to the
  step peak, not the sum of saved sizes;
- [Constraint] optionally retained <= a second cap (a caller's budget for what each block
  holds while the others run: the step peak at the LM head is the sum of the blocks' retained);
- objective: minimise recompute seconds, the roofline time of every forward op replayed
  (`trainplan.costmodels.step.roofline.region_cost`'s node times plus the profile's per-op overhead).

Bytes are exact integers; time is in picoseconds. Each solve starts from a complete greedy hint
(most recompute time saved per retained byte first) and has a time limit; identical rows are
merged, so a Llama block is 46 decisions and 79 constraints. Solving it for a ladder of caps gives the
block's Pareto menu of (peak bytes, recompute seconds); sizes are polynomials in (b, s), so the
menu depends on the shape: at long sequence attention's s**2 FLOPs make its output the cheapest
to keep per second of recompute saved, and linear and elementwise outputs the cheapest to
recompute (AutoSP's observation), from the cost model and not from a rule.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from trainplan.costmodels.checkpoint_sets import BUILTIN, CheckpointSet, keys_of, node_keys
from trainplan.costmodels.graph import poly_at
from trainplan.costmodels.step.remat_cost import BlockCase, SetCost, evaluate, forward_node_times

BYTES_PER_UNIT = 1              # memory rows are exact bytes
SECONDS_PER_UNIT = 1e-12        # recompute time in picoseconds
MENU_SIZE = 8                   # solved caps per block shape (plus baselines' peaks)
BLOCK_TIME_LIMIT_S = 1.0


@dataclass(frozen=True, kw_only=True, slots=True)
class LinearMemory:
    """Live bytes of a checkpointed block as linear functions of the save decisions.

    Row t (one per allocation moment) is const[t] + coef[t] @ x over `candidates`; `fwd` marks
    rows in the forward; `retained` is ret_const + ret_coef @ x."""

    candidates: tuple[str, ...]
    const: np.ndarray
    coef: np.ndarray
    fwd: np.ndarray
    ret_const: float
    ret_coef: np.ndarray
    time_ps: np.ndarray
    """Recompute picoseconds each candidate's replay costs (saved by keeping it)."""
    fixed_recompute_s: float
    """Replay seconds no decision avoids (views, ops whose outputs are never kept)."""

    def rows(self, stack: int) -> tuple[np.ndarray, np.ndarray]:
        """(const, coef) of (stack - 1) * retained + live_t, one row per moment."""
        return self.const + (stack - 1) * self.ret_const, self.coef + (stack - 1) * self.ret_coef[None, :]

    def peaks(self, x: np.ndarray) -> tuple[float, float, float]:
        """(retained, forward peak, backward peak) for 0/1 decisions x."""
        live = self.const + self.coef @ x
        f = live[self.fwd].max(initial=0.0)
        t = live[~self.fwd].max(initial=0.0)
        return float(self.ret_const + self.ret_coef @ x), float(f), float(t)


def linear_memory(case: BlockCase) -> LinearMemory:
    """The block's lifetime replay (as `simulate_region(checkpoint=True)`) with each storage's
    lifetime split by whether its creating op is saved."""
    region, b, s = case.region, case.b, case.s
    bnd, n = region.boundary, region.n_nodes
    horizon = region.recompute_horizon()
    bwd_start = bnd + 0.5

    def t_re(k: int) -> float:  # as in simulate_region
        return bnd + 0.5 + 0.4 * (k + 1) / (bnd + 2)

    cands = sorted({r.creator for r in region.storages if r.category == "act" and not r.is_fwd_output
                    and r.created <= horizon and poly_at(r.bytes, b, s) > 0},
                   key=lambda v: region.graph.nodes[v]["order"])
    idx = {v: i for i, v in enumerate(cands)}
    # intervals: (t0, t1, bytes, candidate index or -1, 1 if alive when saved / 0 when not / -1 fixed)
    iv: list[tuple[float, float, float, int, int]] = []
    for r in region.storages:
        if r.category == "param" or r.input_kind in ("shared", "const"):
            continue
        nb = poly_at(r.bytes, b, s)
        if nb == 0:
            continue
        last = r.last_use if r.last_use < n else n - 0.25
        if r.is_fwd_output:
            iv.append((r.created, bnd, nb, -1, -1))
        elif r.input_kind == "grad":
            iv.append((bwd_start, last, nb, -1, -1))
        elif r.category == "input":
            end = last if r.last_use > bnd else r.last_fwd_use
            iv.append((0, max(end, bwd_start), nb, -1, -1))
        elif r.category in ("grad", "temp"):
            iv.append((r.created, last, nb, -1, -1))
        else:
            j = idx.get(r.creator, -1)
            if j >= 0:
                iv.append((r.created, last if r.last_use > bnd else t_re(r.created), nb, j, 1))
            recomputed: list[tuple[float, float]] = [(r.created, r.last_fwd_use)]
            if r.created <= horizon:
                recomputed.append((t_re(r.created), last if r.last_use > bnd
                                   else t_re(min(r.last_fwd_use, horizon))))
            iv += [(t0, t1, nb, j, 0 if j >= 0 else -1) for t0, t1 in recomputed]
    starts, ends, sizes, who_f, when_f = (np.array(c, dtype=float) for c in zip(*iv, strict=False))
    who, when = who_f.astype(int), when_f.astype(int)
    moments = np.unique(starts)
    alive = ((starts[None, :] <= moments[:, None]) & (moments[:, None] <= ends[None, :])) * sizes[None, :]
    held = ((starts <= bnd) & (ends > bnd)) * sizes
    k = len(cands)
    # a candidate's interval counts x_v (saved) or 1 - x_v (recomputed): constant + coefficient
    onehot = np.zeros((len(iv), k))
    sign = np.where(when == 1, 1.0, np.where(when == 0, -1.0, 0.0))
    onehot[who >= 0, who[who >= 0]] = sign[who >= 0]
    base = (when != 1).astype(float)  # fixed and recomputed intervals count at x = 0
    times = forward_node_times(case)
    g = region.graph
    time_ps = np.array([round((times[v][1] + case.hw.op_overhead_s) / SECONDS_PER_UNIT) for v in cands], dtype=float)
    fixed = sum(t + case.hw.op_overhead_s for v, (_, t) in times.items()
                if v not in idx and g.nodes[v]["order"] <= horizon)
    return LinearMemory(candidates=tuple(cands), const=alive @ base, coef=alive @ onehot,
                        fwd=moments <= bnd, ret_const=float(held @ base), ret_coef=held @ onehot,
                        time_ps=time_ps, fixed_recompute_s=fixed)


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockSolution:
    """The per-block model's answer at one cap."""

    saved: frozenset[str]
    """Forward nodes whose outputs are kept."""
    status: str
    """CP-SAT's status (OPTIMAL; FEASIBLE: the time limit ended the search), GREEDY (the time
    limit passed before CP-SAT found a solution; the greedy hint's), INFEASIBLE (nothing fits
    the cap) or UNKNOWN (no solution found in time)."""
    wall_s: float
    avoided_ps: int = 0
    """Replay picoseconds the solution avoids (the objective, maximised)."""
    bound_ps: int = 0
    """CP-SAT's bound on it: equal to `avoided_ps` when OPTIMAL."""

    @property
    def found(self) -> bool:
        return self.status in ("OPTIMAL", "FEASIBLE", "GREEDY")


def greedy_hint(lm: LinearMemory, stack: int, cap: float, retained_cap: float | None = None) -> np.ndarray:
    """Keep outputs in order of recompute time saved per retained byte while every row (and
    the retained bytes) fit."""
    const, coef = lm.rows(stack)
    x = np.zeros(len(lm.candidates))
    if (const > cap).any():
        return x
    live, held = const.copy(), lm.ret_const
    rcap = math.inf if retained_cap is None else retained_cap
    density = lm.time_ps / np.maximum(lm.ret_coef, 1.0)
    for j in np.argsort(-density, kind="stable"):
        trial = live + coef[:, j]
        if (trial <= cap).all() and held + lm.ret_coef[j] <= rcap:
            x[j], live, held = 1.0, trial, held + lm.ret_coef[j]
    return x


class BlockModel:
    """The per-block CP-SAT model of one case, built once and solved for any number of caps."""

    def __init__(self, case: BlockCase, lm: LinearMemory | None = None):
        # ---- data: one row per distinct coefficient vector, with its largest constant
        self.case, self.lm = case, lm or linear_memory(case)
        const, coef = self.lm.rows(case.stack)
        coef = np.rint(coef / BYTES_PER_UNIT).astype(np.int64)
        const = np.ceil(const / BYTES_PER_UNIT).astype(np.int64)
        moving = coef.any(axis=1)
        self.floor = int(const[~moving].max(initial=0))  # rows no decision changes
        self.lowest = int((const + np.minimum(coef, 0).sum(axis=1)).max(initial=0))
        uniq, inv = np.unique(coef[moving], axis=0, return_inverse=True)
        top = np.full(len(uniq), np.iinfo(np.int64).min)
        np.maximum.at(top, inv.ravel(), const[moving])
        self.rows_int = (uniq, top)
        upper = int(max(self.floor, (top + np.maximum(uniq, 0).sum(axis=1)).max(initial=0)))
        # ---- variables
        m = self.model = cp_model.CpModel()
        self.save = [m.new_bool_var(f"save_{v}") for v in self.lm.candidates]  # keep v's output
        self.peak = m.new_int_var(0, upper, "stacked_peak_units")  # (stack-1)*retained + live, max
        ret_coef = self.ret_coef = np.rint(self.lm.ret_coef / BYTES_PER_UNIT).astype(np.int64)
        self.ret_const = int(math.ceil(self.lm.ret_const / BYTES_PER_UNIT))
        self.ret_upper = self.ret_const + int(np.maximum(ret_coef, 0).sum())
        self.retained = m.new_int_var(0, self.ret_upper, "retained_units")  # held from forward to backward
        # ---- constraints
        for row, c0 in zip(uniq, top, strict=False):  # [Constraint] stacked live bytes at each moment <= peak
            nz = np.flatnonzero(row)
            m.add(cp_model.LinearExpr.weighted_sum([self.save[j] for j in nz], [int(row[j]) for j in nz])
                  + int(c0) <= self.peak)
        # [Constraint] retained bytes <= retained (capped when a caller bounds them)
        m.add(cp_model.LinearExpr.weighted_sum(self.save, [int(v) for v in ret_coef]) + self.ret_const
              <= self.retained)
        self.ret_min = self.ret_const + int(np.minimum(ret_coef, 0).sum())
        # ---- objective: the most replay time avoided = the least recompute
        m.maximize(cp_model.LinearExpr.weighted_sum(self.save, [int(t) for t in self.lm.time_ps]))

    def solve(self, cap_bytes: float, *, retained_cap_bytes: float | None = None,
              time_limit_s: float = BLOCK_TIME_LIMIT_S, seed: int = 0, workers: int = 1,
              export_path: str | None = None) -> BlockSolution:
        """Least recompute with the stacked peak at most `cap_bytes` (and the retained bytes at
        most `retained_cap_bytes`); INFEASIBLE when even recomputing everything does not fit."""
        t0 = time.perf_counter()
        cap = math.floor(cap_bytes / BYTES_PER_UNIT)
        ret_cap = (self.ret_upper if retained_cap_bytes is None
                   else min(self.ret_upper, math.floor(retained_cap_bytes / BYTES_PER_UNIT)))
        if cap < max(self.floor, self.lowest) or ret_cap < self.ret_min:
            return BlockSolution(saved=frozenset(), status="INFEASIBLE", wall_s=time.perf_counter() - t0)
        m = self.model
        m.proto.variables[self.peak.index].domain[1] = cap  # the caps are the two variables' bounds
        m.proto.variables[self.retained.index].domain[1] = ret_cap
        m.clear_hints()
        hint = greedy_hint(self.lm, self.case.stack, cap * BYTES_PER_UNIT,
                           None if retained_cap_bytes is None else ret_cap * BYTES_PER_UNIT).astype(np.int64)
        uniq, top = self.rows_int
        hint_peak = int(max(self.floor, (top + uniq @ hint).max(initial=0)))
        hint_ret = int(self.ret_const + self.ret_coef @ hint)
        hint_fits = hint_peak <= cap and hint_ret <= ret_cap
        if hint_fits:  # a complete, feasible hint
            for x, h in zip(self.save, hint, strict=False):
                m.add_hint(x, bool(h))
            m.add_hint(self.peak, max(hint_peak, 0))
            m.add_hint(self.retained, max(hint_ret, 0))
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = time_limit_s
        solver.parameters.random_seed = seed
        solver.parameters.num_workers = workers
        # solved many times from a complete feasible hint: presolve costs more than it saves
        # (measured: 2-5x slower to optimality up to 150 decisions, no solution in 1 s at 300)
        solver.parameters.cp_model_presolve = False
        if export_path:
            m.export_to_file(export_path)
        status = solver.solve(m)
        wall = time.perf_counter() - t0
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):  # ---- read the solution
            chosen = frozenset(v for v, x in zip(self.lm.candidates, self.save, strict=False) if solver.value(x))
            return BlockSolution(saved=chosen, status=solver.status_name(status), wall_s=wall,
                                 avoided_ps=int(solver.objective_value),
                                 bound_ps=int(solver.best_objective_bound))
        if status == cp_model.UNKNOWN and hint_fits:
            chosen = frozenset(v for v, h in zip(self.lm.candidates, hint, strict=False) if h)
            return BlockSolution(saved=chosen, status="GREEDY", wall_s=wall,
                                 avoided_ps=int(self.lm.time_ps @ hint))
        return BlockSolution(saved=frozenset(), wall_s=wall,
                             status="INFEASIBLE" if status == cp_model.INFEASIBLE else "UNKNOWN")

def solve_block(case: BlockCase, cap_bytes: float, **options) -> BlockSolution:
    """Least recompute time for `case`'s block with its stacked peak at most `cap_bytes`
    (checkpointed; plain autograd is the menu's `none` entry). Options: `BlockModel.solve`'s."""
    return BlockModel(case).solve(cap_bytes, **options)


@dataclass(frozen=True, kw_only=True, slots=True)
class MenuEntry:
    entry: CheckpointSet
    cost: SetCost


@dataclass(frozen=True, kw_only=True, slots=True)
class Menu:
    """A block's Pareto menu at one shape: `none`, solved entries, `full`, sorted from the
    most memory (least recompute) to the least; no entry is dominated by another."""

    entries: tuple[MenuEntry, ...]
    solves: int
    wall_s: float
    """Seconds to build it (all CP-SAT solves and exact evaluations)."""


def pareto_menu(case: BlockCase, *, size: int = MENU_SIZE, baselines=("save_attention", "save_matmuls"),
                targets: tuple[tuple[float, float], ...] = (), time_limit_s: float = BLOCK_TIME_LIMIT_S,
                seed: int = 0) -> Menu:
    """Solve the block for `size` caps between full checkpointing's stacked peak and the
    lowest of no checkpointing's and saving everything's, plus the peaks of `baselines` (so
    the menu matches or beats them where they fit) and the (stacked peak, retained bytes) caps
    `targets` (a caller's budgets for one block). Solved entries are named `remat:k`."""
    t0 = time.perf_counter()
    region = case.region
    bm = BlockModel(case)
    lm = bm.lm
    keys = node_keys(region)
    none, full = (MenuEntry(entry=BUILTIN[k], cost=evaluate(case, BUILTIN[k])) for k in ("none", "full"))
    everything = CheckpointSet(name="all", saved=frozenset(keys[v] for v in lm.candidates))
    lo = full.cost.peak_bytes
    hi = min(none.cost.peak_bytes, evaluate(case, everything).peak_bytes)
    caps = [lo + (hi - lo) * (i + 1) / size for i in range(size)]
    caps += [evaluate(case, BUILTIN[k]).peak_bytes for k in baselines]
    found: dict[frozenset, MenuEntry] = {}
    solves = 0
    ladder = [(c, None) for c in sorted({c for c in caps if lo < c <= hi}, reverse=True)]
    for cap, ret_cap in ladder + [(min(p, hi), r) for p, r in targets if p > lo]:
        sol = bm.solve(cap, retained_cap_bytes=ret_cap, time_limit_s=time_limit_s, seed=seed)
        solves += 1
        if not sol.found or sol.saved in found:
            continue
        entry = CheckpointSet(name="remat", saved=keys_of(region, sol.saved))
        found[sol.saved] = MenuEntry(entry=entry, cost=evaluate(case, entry))
    pool = [none, *found.values(), full]
    kept = [e for e in pool if not any(_dominates(o.cost, e.cost) for o in pool if o is not e)]
    for must in (none, full):  # always on the menu: feasibility never gets worse
        if must not in kept:
            kept.append(must)
    kept.sort(key=lambda e: (-e.cost.peak_bytes, e.cost.recompute_s))
    named, k = [], 0
    for e in kept:
        if e.entry.name == "remat":
            k += 1
            e = MenuEntry(entry=CheckpointSet(name=f"remat:{k}", saved=e.entry.saved), cost=e.cost)
        named.append(e)
    return Menu(entries=tuple(named), solves=solves, wall_s=time.perf_counter() - t0)


def _dominates(a: SetCost, b: SetCost) -> bool:
    le = (a.peak_bytes <= b.peak_bytes and a.recompute_s <= b.recompute_s
          and a.retained_bytes <= b.retained_bytes)
    return le and (a.peak_bytes < b.peak_bytes or a.recompute_s < b.recompute_s
                   or a.retained_bytes < b.retained_bytes)
