"""Checkpoint-set strategies for one transformer block, behind one signature, baselines beside
the optimizer (as PyTorch's `knapsack.py` greedy / ilp / dp, or checkmate's `strategy_*`).

    strategy(case: BlockCase, cap_bytes: float) -> CheckpointSet | None

`case` is one block at one shape (`trainplan.costmodels.step.remat_cost.BlockCase`), `cap_bytes` a cap on its
stacked peak ((stack - 1) * retained + its own forward/backward peak, `SetCost.peak_bytes`). A
strategy returns the set it would run, or None when it has nothing that fits. Every returned
set is judged by the same exact cost (`trainplan.costmodels.step.remat_cost.evaluate`).

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
  `trainplan.planner.joint.remat_solver` (least recompute under the real stacked peak).
"""

from __future__ import annotations

from collections.abc import Callable

from trainplan.costmodels.checkpoint_sets import BUILTIN, CheckpointSet, keys_of
from trainplan.costmodels.step.remat_cost import BlockCase, evaluate
from trainplan.modeling.torch_private import dp_knapsack, greedy_knapsack, ilp_knapsack
from trainplan.planner.joint.remat_solver import BlockModel, LinearMemory, linear_memory

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


def knapsack_set(case: BlockCase, budget: float, solver: str = "dp", *,
                 lm: LinearMemory | None = None) -> CheckpointSet:
    """The set torch's knapsack `solver` keeps at `activation_memory_budget=budget`; `lm`: the
    case's `linear_memory`, when already built."""
    lm = lm or linear_memory(case)
    total = float(lm.ret_coef.clip(min=0).sum()) or 1.0
    memory = [max(float(m), 0.0) / total for m in lm.ret_coef]
    runtime = [float(t) * 1e-12 for t in lm.time_ps]
    if not memory:
        return CheckpointSet(name=f"torch_knapsack_{solver}", saved=frozenset())
    fn = {"dp": dp_knapsack, "greedy": _greedy, "ilp": ilp_knapsack}[solver]
    _, keep, _ = fn(memory, runtime, budget)
    return CheckpointSet(name=f"torch_knapsack_{solver}",
                         saved=keys_of(case.region, [lm.candidates[i] for i in keep]))


def _greedy(memory: list[float], runtime: list[float], max_memory: float) -> tuple[float, list[int], list[int]]:
    # torch's greedy divides by memory; outputs of zero bytes are free to keep
    eps = min([m for m in memory if m > 0], default=1.0) * 1e-9
    return greedy_knapsack([m or eps for m in memory], runtime, max_memory)


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
