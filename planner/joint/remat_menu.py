"""The checkpoint menus of the joint solver (`trainplan.planner.joint.solver`): the named entries of a
search space, and each binding block shape's solved Pareto menu (`remat:k`,
`trainplan.planner.joint.remat_solver.pareto_menu`), solved once per step model, block shape and targets
(`BlockMenus`) and added to the combos of that shape where memory binds (`add_menus`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Protocol

from trainplan.costmodels.checkpoint_sets import BUILTIN, MENU, check_policy, saved_nodes
from trainplan.costmodels.step.model import Choice, StepModel
from trainplan.costmodels.step.precision import PRECISIONS
from trainplan.costmodels.step.remat_cost import BlockCase
from trainplan.errors import TrainplanError
from trainplan.planner.joint.combos import Combo, entry_costs, fits_uniform, menu_targets
from trainplan.planner.joint.remat_solver import Menu, pareto_menu

Targets = tuple[tuple[float, float], ...]
"""Extra (stacked peak, retained) caps, bytes, a block's menu is also solved at."""


def block_case(sm: StepModel, c: Choice, i: int = 0) -> BlockCase:
    """Block i's rematerialization problem at `c`'s shape (`trainplan.planner.joint.remat_solver`); its
    stack is the number of layers that run the same region."""
    name = sm.blocks[i]
    return BlockCase(region=sm.regions[name], b=c.micro_batch, s=c.seq_len // c.sp_degree,
                     sp=c.sp_degree, hw=sm.hw, dtype=PRECISIONS[c.precision][3],
                     stack=sm.blocks.count(name))


class MenuSource(Protocol):
    """Where the joint solver gets block i's Pareto menu at a choice's shape."""

    def menu(self, c: Choice, i: int = 0, targets: Targets = ()) -> Menu: ...


class BlockMenus:
    """The Pareto menus of one step model's blocks (`pareto_menu` of `block_case`, with the extra
    caps `targets`), each solved once per distinct region, shape and targets: a problem's menus
    (`trainplan.planner.joint.problem.Problem.menus`), kept across its re-solves."""

    def __init__(self, step_model: StepModel) -> None:
        self.step_model = step_model
        self._menus: dict[tuple, Menu] = {}

    def menu(self, c: Choice, i: int = 0, targets: Targets = ()) -> Menu:
        """Block i's Pareto menu at `c`'s shape with the extra caps `targets`."""
        sm = self.step_model
        key = (sm.blocks[i], c.micro_batch, c.seq_len // c.sp_degree, c.sp_degree, c.precision, targets)
        if key not in self._menus:
            self._menus[key] = pareto_menu(block_case(sm, c, i), targets=targets)
        return self._menus[key]


def by_recompute(entries: Iterable[str]) -> list[str]:
    """Entries from least to most recompute, roughly: `none`, solved `remat:k` in menu order,
    the named selective entries, `full`."""
    order = ("none", MENU, "save_matmuls", "save_attention", "full")

    def rank(e: str) -> int:
        return order.index(MENU) if e.startswith(MENU + ":") else (order.index(e) if e in order else len(order))

    return sorted(entries, key=lambda e: (rank(e), menu_index(e)))


def menu_index(e: str) -> int:
    """k of a solved entry `remat:k`, 0 for the named ones."""
    return int(e.split(":", 1)[1]) if e.startswith(MENU + ":") else 0


def named_entries(policies: Iterable[str]) -> list[str]:
    """The built-in entries of a search space; with the solved menu (`remat`), `none` and
    `full` are always among them.

    Raises:
        TrainplanError: an unknown entry, or none at all."""
    policies = tuple(policies)
    named = [e for e in policies if e != MENU]
    for e in named:
        check_policy(e)
    if MENU in policies:
        named = ["none"] + [e for e in named if e not in ("none", "full")] + ["full"]
    if not named:
        raise TrainplanError("the checkpoint menu is empty: give at least one policy")
    return named


def add_menus(sm: StepModel, combos: Sequence[Combo], limit: float, menus: MenuSource) -> list[Combo]:
    """`combos` with each block shape's solved menu (`menus`) added to the combos of that shape
    where memory binds: no checkpointing does not fit and full checkpointing does (elsewhere
    `none` or nothing wins). Besides its ladder, the menu is solved at each such combo's own
    budget for one block with every block alike (`trainplan.planner.joint.combos.menu_targets`: the
    stacked peak and retained bytes that fit the limit beside the bytes every block phase
    holds), so that budget has its best entry. Combos with a tiled MLP keep their menu
    (`none`, `full`: `trainplan.costmodels.step.model.Choice.mlp_chunks`)."""
    L = len(sm.blocks)
    region = sm.regions[sm.blocks[0]]
    by_shape: dict[tuple[int, int], list[Combo]] = {}
    for c in combos:
        if c.choice.mlp_chunks > 1:  # a tiled MLP runs under `none` or `full` only
            continue
        if not fits_uniform(c, "none", L, limit) and fits_uniform(c, "full", L, limit):
            by_shape.setdefault((c.choice.sp_degree, c.choice.micro_batch), []).append(c)
    added: dict[int, Combo] = {}
    for group in by_shape.values():
        targets = sorted({menu_targets(c, L, limit) for c in group})
        menu = menus.menu(group[0].choice, targets=tuple(targets))
        have = {saved_nodes(region, x.entry) if x.entry.checkpointed else None for x in group[0].menu.values()}
        extra = {me.entry.name: me.entry for me in menu.entries
                 if me.entry.name not in BUILTIN and saved_nodes(region, me.entry) not in have}
        for c in group:
            added[id(c)] = dataclasses.replace(c, menu={**c.menu, **entry_costs(sm, c.choice, extra)})
    return [added.get(id(c), c) for c in combos]
