"""Checkpoint-set strategies for one transformer block, behind one signature, baselines beside
the optimizer (as PyTorch's `knapsack.py` greedy / ilp / dp, or checkmate's `strategy_*`).

    strategy(case: BlockCase, cap_bytes: float) -> CheckpointSet | None

`case` is one block at one shape (`planner.joint.remat_solver.BlockCase`), `cap_bytes` a cap on its
stacked peak ((stack - 1) * retained + its own forward/backward peak, `SetCost.peak_bytes`). A
strategy returns the set it would run, or None when it has nothing that fits. Every returned
set is judged by the same exact cost (`planner.joint.remat_solver.evaluate`).

- `no_ac`: no activation checkpointing.
- `full_ac`: full checkpointing per block (Chen et al. 2016).
- `autosp`: AutoSP's rule, keep attention outputs and recompute everything else.
- `torch_knapsack_{dp,greedy,ilp}`: PyTorch's `activation_memory_budget` knapsack
  (`torch._functorch._activation_checkpointing.knapsack`) on our block's forward ops: memory
  = each output's retained bytes as a fraction of all of them, runtime = its recompute seconds,
  max_memory = the budget. Its model is the sum of saved sizes; the budget is tuned as a user
  would, the least-recompute set over budgets 0, 0.05, ..., 1 whose real peak fits the cap.
  (torch's own partitioner applies these solvers to the graph `torch.compile` traces; here
  they run on our captured block, with our sizes and times, so that every strategy is judged
  by the same memory model and run by the same eager executor.)
- `optimal`: no checkpointing where it fits, else the CP-SAT model of
  `planner.joint.remat_solver` (least recompute under the real stacked peak).

Below them, the helpers with which `planner.joint.solver` builds each combo's checkpoint menu: the
named entries, and each binding block shape's solved Pareto menu (`remat:k`).
"""

from __future__ import annotations

from collections.abc import Callable

from costmodels.checkpoint_sets import BUILTIN, MENU, CheckpointSet, check_policy, keys_of, saved_nodes
from costmodels.step.model import Choice, StepModel
from planner.joint.remat_solver import BlockCase, BlockModel, evaluate, linear_memory
from trainplan_errors import TrainplanError

Strategy = Callable[[BlockCase, float], "CheckpointSet | None"]
BUDGETS = tuple(i / 20 for i in range(21))
"""activation_memory_budget values the torch baseline is tuned over."""


def _if_fits(case: BlockCase, cap: float, entry: CheckpointSet) -> CheckpointSet | None:
    return entry if evaluate(case, entry).peak_bytes <= cap else None


def no_ac(case: BlockCase, cap_bytes: float) -> CheckpointSet | None:
    """No activation checkpointing."""
    return _if_fits(case, cap_bytes, BUILTIN["none"])


def full_ac(case: BlockCase, cap_bytes: float) -> CheckpointSet | None:
    """Full checkpointing: keep only the block's input."""
    return _if_fits(case, cap_bytes, BUILTIN["full"])


def autosp(case: BlockCase, cap_bytes: float) -> CheckpointSet | None:
    """AutoSP's sequence-aware rule: keep attention outputs, recompute the rest."""
    return _if_fits(case, cap_bytes, BUILTIN["save_attention"])


def knapsack_set(case: BlockCase, budget: float, solver: str = "dp", *, lm=None) -> CheckpointSet:
    """The set torch's knapsack `solver` keeps at `activation_memory_budget=budget`."""
    from torch._functorch._activation_checkpointing import knapsack

    lm = lm or linear_memory(case)
    total = float(lm.ret_coef.clip(min=0).sum()) or 1.0
    memory = [max(float(m), 0.0) / total for m in lm.ret_coef]
    runtime = [float(t) * 1e-12 for t in lm.time_ps]
    if not memory:
        return CheckpointSet(name=f"torch_knapsack_{solver}", saved=frozenset())
    fn = {"dp": knapsack.dp_knapsack, "greedy": _greedy, "ilp": knapsack.ilp_knapsack}[solver]
    _, keep, _ = fn(memory, runtime, budget)
    return CheckpointSet(name=f"torch_knapsack_{solver}",
                         saved=keys_of(case.region, [lm.candidates[i] for i in keep]))


def _greedy(memory, runtime, max_memory):
    from torch._functorch._activation_checkpointing import knapsack

    # torch's greedy divides by memory; outputs of zero bytes are free to keep
    eps = min([m for m in memory if m > 0], default=1.0) * 1e-9
    return knapsack.greedy_knapsack([m or eps for m in memory], runtime, max_memory)


def torch_knapsack(solver: str = "dp") -> Strategy:
    """PyTorch's memory-budget knapsack with `solver` (dp, greedy, ilp), budget tuned to the cap."""

    def strategy(case: BlockCase, cap_bytes: float) -> CheckpointSet | None:
        plain = no_ac(case, cap_bytes)
        if plain is not None:  # budget 1.0: torch's default partition, nothing recomputed
            return plain
        lm = linear_memory(case)
        best = None
        for entry in {knapsack_set(case, budget, solver, lm=lm) for budget in BUDGETS}:
            cost = evaluate(case, entry)
            if cost.peak_bytes <= cap_bytes and (best is None or cost.recompute_s < best[0]):
                best = (cost.recompute_s, entry)
        return best[1] if best else None

    strategy.__name__ = f"torch_knapsack_{solver}"
    return strategy


def optimal(case: BlockCase, cap_bytes: float) -> CheckpointSet | None:
    """The least-recompute set under the real stacked peak (CP-SAT), or no checkpointing."""
    plain = no_ac(case, cap_bytes)
    if plain is not None:
        return plain
    sol = BlockModel(case).solve(cap_bytes)
    if not sol.found:
        return None
    return CheckpointSet(name="optimal", saved=keys_of(case.region, sol.saved))


STRATEGIES: dict[str, Strategy] = {
    "no_ac": no_ac,
    "full_ac": full_ac,
    "autosp": autosp,
    "torch_knapsack_dp": torch_knapsack("dp"),
    "torch_knapsack_greedy": torch_knapsack("greedy"),
    "torch_knapsack_ilp": torch_knapsack("ilp"),
    "optimal": optimal,
}
BASELINES = tuple(k for k in STRATEGIES if k != "optimal")


# ---------------------------------------------------------------- menus for the joint solver


def by_recompute(entries) -> list[str]:
    """Entries from least to most recompute, roughly: `none`, solved `remat:k` in menu order,
    the named selective entries, `full`."""
    order = ("none", MENU, "save_matmuls", "save_attention", "full")
    rank = lambda e: order.index(MENU) if e.startswith(MENU + ":") else (  # noqa: E731
        order.index(e) if e in order else len(order))
    return sorted(entries, key=lambda e: (rank(e), menu_index(e)))


def menu_index(e: str) -> int:
    """k of a solved entry `remat:k`, 0 for the named ones."""
    return int(e.split(":", 1)[1]) if e.startswith(MENU + ":") else 0


def named_entries(policies) -> list[str]:
    """The built-in entries of a search space; with the solved menu (`remat`), `none` and
    `full` are always among them."""
    named = [e for e in policies if e != MENU]
    for e in named:
        check_policy(e)
    if MENU in policies:
        named = ["none"] + [e for e in named if e not in ("none", "full")] + ["full"]
    if not named:
        raise TrainplanError("the checkpoint menu is empty: give at least one policy")
    return named


def fits_uniform(c: dict, e: str, L: int, limit: float) -> bool:
    """Whether every block on entry e fits `limit` (`planner.joint.solver`'s memory constraints with
    n_e = L, in exact bytes: `planner.joint.combos.fits_uniform`)."""
    from planner.joint.combos import fits_uniform as fits

    return fits(c, e, L, limit)


def entry_numbers(sm: StepModel, base: Choice, sets: dict) -> dict:
    """Per checkpoint entry of one combo: retained (R), forward peak (F) and backward peak (T)
    bytes of one block, its seconds per step and the step's FLOPs with every block on it."""
    L = len(sm.blocks)
    none_rt = sm.runtime(base)
    out = {k: {} for k in ("R", "F", "T", "block_s", "flops")}
    for e, entry in sets.items():
        mem = sm.block_memory(base, 0, entry)
        out["R"][e], out["F"][e], out["T"][e] = mem.retained, mem.fwd_peak.total, mem.bwd_peak.total
        out["block_s"][e] = sm.block_time(base, 0, entry)
        out["flops"][e] = none_rt.flops + L * sm.block_cost(base, 0, entry).recompute_flops
    out["sets"] = dict(sets)
    out["fixed_s"] = none_rt.time_s - L * sm.block_time(base, 0, "none")
    return out


def add_menus(sm: StepModel, combos: list[dict], named: list[str], limit: float) -> None:
    """Add each block shape's solved menu (`StepModel.menu`) to the combos of that shape where
    memory binds: no checkpointing does not fit and full checkpointing does (elsewhere `none`
    or nothing wins). Besides its ladder, the menu is solved at each such combo's own budget
    for one block with every block alike (`planner.joint.combos.menu_targets`: the stacked peak and
    retained bytes that fit the limit beside the bytes every block phase holds), so that
    budget has its best entry."""
    from planner.joint.combos import menu_targets

    L = len(sm.blocks)
    region = sm.regions[sm.blocks[0]]
    by_shape: dict[tuple, list[dict]] = {}
    for c in combos:
        if not fits_uniform(c, "none", L, limit) and fits_uniform(c, "full", L, limit):
            by_shape.setdefault((c["sp"], c["mb"]), []).append(c)
    for group in by_shape.values():
        targets = sorted({menu_targets(c, L, limit) for c in group})
        menu = sm.menu(group[0]["choice"], targets=tuple(targets))
        have = {saved_nodes(region, x) if x.checkpointed else None for x in group[0]["sets"].values()}
        extra = {me.entry.name: me.entry for me in menu.entries
                 if me.entry.name not in BUILTIN and saved_nodes(region, me.entry) not in have}
        for c in group:
            more = entry_numbers(sm, c["choice"], extra)
            for k in ("R", "F", "T", "block_s", "flops", "sets"):
                c[k].update(more[k])
