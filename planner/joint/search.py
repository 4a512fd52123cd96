"""Steps of the joint search over combos (`trainplan.planner.joint.solver.solve_joint`): exact pruning of
the combos, the compute constraint's terms, a feasible start, spending the whole budget at the
chosen knobs, and the error when no combo fits memory. Combos and their memory rows are
`trainplan.planner.joint.combos`'.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

from trainplan.costmodels.loss.law import LossLaw
from trainplan.costmodels.loss.planned import run_loss
from trainplan.costmodels.step.model import Choice, StepModel
from trainplan.errors import InfeasibleError
from trainplan.hardware_profiles import HardwareProfile
from trainplan.planner.budget import Budget
from trainplan.planner.joint.combos import BYTES_PER_UNIT, Combo, EntryCost, fits_uniform, memory_rows, units

MICROS_PER_UNIT = 1e-6          # time in microseconds


def budget_cap(budget: Budget, wall: float | None) -> float:
    """The compute constraint's cap: `wall` seconds under a time budget (`Budget.wall_s_for`),
    else the FLOP budget's FLOPs."""
    if wall is not None:
        return wall
    assert budget.flops is not None, "a budget without wall-clock seconds is a FLOP budget"
    return budget.flops


def _shape_terms(c: Combo) -> tuple[float, ...]:
    m = c.memory
    return (m.base_bytes, m.tail_bytes, m.fwd_unsharded_bytes, m.bwd_fixed_bytes, m.per_later_block_bytes,
            m.per_earlier_block_bytes, m.reduce_scatter_bytes, c.fixed_s)


def _entry_terms(x: EntryCost) -> tuple[float, ...]:
    return x.retained_bytes, x.fwd_peak_bytes, x.bwd_peak_bytes, x.block_s, x.step_flops


def undominated(combos: list[Combo]) -> list[Combo]:
    """Drop each combo another beats or ties everywhere: the same tokens per step and optimizer
    width, every checkpoint entry of its menu on the other's too, and no more bytes, seconds or
    FLOPs in any term of the model (e.g. ZeRO-1 against ZeRO-2, whose communication the model
    prices alike). Exact: the solver's optimum is unchanged. Of equal combos the first stays."""
    shape = {id(c): _shape_terms(c) for c in combos}

    def le(a: Combo, b: Combo) -> bool:
        return (a.tokens_per_step == b.tokens_per_step and a.bits == b.bits
                and all(e in a.menu for e in b.menu)
                and all(x <= y for x, y in zip(shape[id(a)], shape[id(b)], strict=True))
                and all(x <= y for e in b.menu
                        for x, y in zip(_entry_terms(a.menu[e]), _entry_terms(b.menu[e]), strict=True)))

    keep = []
    for i, c in enumerate(combos):
        if not any(le(o, c) and (j < i or not le(c, o)) for j, o in enumerate(combos) if j != i):
            keep.append(c)
    return keep


def prune_narrower(combos: list[Combo], L: int, mem_cap: int, bits_pen: Mapping[tuple[int, int], float],
                   wall: float | None) -> list[Combo]:
    """Drop each combo that another of the same SP degree, ZeRO stage and micro-batch beats at
    its fastest: a width of no more loss penalty (`bits_pen`) whose plan with every block
    unchecked (`none`, no recompute) fits memory (`mem_cap`, in the solver's rounded units) at no
    more cost per step (seconds, or FLOPs under a FLOP budget) than this combo's own all-`none`
    plan, which is the cheapest it can run. Exact: lower bits only pay where memory binds."""
    if any("none" not in c.menu for c in combos):
        return combos

    def cost(c: Combo) -> float:
        return c.fixed_s + L * c.menu["none"].block_s if wall is not None else c.menu["none"].step_flops

    def fits_unchecked(c: Combo) -> bool:
        return all(v <= mem_cap for _, _, v in memory_rows(c, ["none"], {"none": L},
                                                           lambda v: units(v, BYTES_PER_UNIT)))

    def shape(c: Combo) -> tuple[int, int, int]:
        return c.choice.sp_degree, c.choice.zero_stage, c.choice.micro_batch

    free = [c for c in combos if fits_unchecked(c)]
    keep = []
    for c in combos:
        beaten = any(shape(o) == shape(c) and o is not c and bits_pen[o.bits] <= bits_pen[c.bits]
                     and cost(o) <= cost(c) and (bits_pen[o.bits] < bits_pen[c.bits] or cost(o) < cost(c)
                                                 or o.bits > c.bits)
                     for o in free)
        if not beaten:
            keep.append(c)
    return keep


def step_cost(c: Combo, counts: Mapping[str, int], L: int, wall: float | None, devices: int) -> float:
    """One optimizer step's cost (all its micro-steps): seconds under a time budget, FLOPs over
    all devices under a FLOP one."""
    if wall is not None:
        return c.fixed_s + sum(counts[e] * c.cost_of(e).block_s for e in counts)
    return sum(counts[e] * c.cost_of(e).step_flops for e in counts) / L * devices


def spent(c: Combo, counts: Mapping[str, int], L: int, wall: float | None, budget: Budget, devices: int,
          law: LossLaw, n_params: int, f: float, data_tokens: int, level: int,
          bits_pen: Mapping[tuple[int, int], float]) -> tuple[float, int]:
    """(predicted loss, optimizer steps) when the whole budget is spent at these knobs (the
    levels are a grid; loss falls with tokens), at least the level's steps."""
    cap = budget_cap(budget, wall)
    steps = max(math.ceil(level / c.tokens_per_step), int(cap // step_cost(c, counts, L, wall, devices)), 1)
    return (run_loss(law, n_params, steps=steps, tokens_per_step=c.tokens_per_step,
                     unique_tokens=max(1.0, f * data_tokens)) + bits_pen[c.bits], steps)


def budget_terms(c: Combo, entries: Sequence[str], L: int, wall: float | None, budget: Budget,
                 devices: int) -> tuple[dict[str, float], float, float, float]:
    """The compute constraint's terms for combo c: (cost per step of one block on each entry,
    fixed cost per step, the cap, the integer unit): seconds under a time budget, FLOPs over
    all devices under a FLOP budget."""
    if wall is not None:
        return {e: c.cost_of(e).block_s for e in entries}, c.fixed_s, wall, MICROS_PER_UNIT
    flops = budget_cap(budget, wall)
    return {e: c.cost_of(e).step_flops / L * devices for e in entries}, 0.0, flops, flops / 1e9


def uniform_start(combos: Sequence[Combo], entries: Sequence[str], L: int, mem_cap: int, levels: Sequence[int],
                  fractions: Sequence[float],
                  terms: Callable[[Combo], tuple[dict[str, float], float, float, float]],
                  loss: Callable[[int, float, Combo], float]) -> tuple[int, str, int, float] | None:
    """A feasible start for the solver: the (combo index, entry, level, fraction) of the lowest
    predicted loss with every block on one entry that fits memory (`fits_uniform` in the
    solver's units: `mem_cap`) and the budget at that level, or None."""
    def q(v: float) -> int:
        return units(v, BYTES_PER_UNIT)

    best = None
    for i, c in enumerate(combos):
        per_step, fixed_cost, cap, scale = terms(c)
        for e in entries:
            if e not in c.menu or not fits_uniform(c, e, L, mem_cap, q):
                continue
            fits = [k for k, t in enumerate(levels)
                    if L * units(math.ceil(t / c.tokens_per_step) * per_step[e], scale)
                    + units(math.ceil(t / c.tokens_per_step) * fixed_cost, scale) <= int(cap / scale)]
            if not fits:
                continue
            for fr in fractions:
                key = (loss(fits[-1], fr, c), -fr)
                if best is None or key < best[0]:
                    best = (key, (i, e, fits[-1], fr))
    return None if best is None else best[1]



Lightest = tuple[float, int, int, int, str]
"""(bytes per device, SP degree, ZeRO stage, micro-batch, the widths (and a gradient
accumulation above 1) in words) of a plan."""


def lightest_uniform(sm: StepModel, combos: Sequence[Choice], named: Sequence[str]) -> Lightest:
    """The lightest plan with every block on one of the `named` entries over the knobs of
    `combos` (at least one), by `StepModel.evaluate`'s peak."""
    best = None
    for base in combos:
        for e in named:
            c = dataclasses.replace(base, policies=(e,) * len(sm.blocks))
            need = sm.evaluate(c).memory.total
            if best is None or need < best[0]:
                accum = f"grad_accum={base.grad_accum}, " if base.grad_accum > 1 else ""
                best = (need, base.sp_degree, base.zero_stage, base.micro_batch,
                        f"{accum}{base.optimizer_bits}-bit optimizer, {base.activation_bits}-bit saved activations")
    assert best is not None, "lightest_uniform needs at least one combo and one entry"
    return best


def memory_infeasible(smallest: Lightest, limit: float, hw: HardwareProfile, seq_len: int,
                      capped: bool) -> InfeasibleError:
    """The error of a search space none of whose combos fits memory, naming the lightest plan
    (`lightest_uniform`) and `limit` (bytes per device; `capped`: a caller's memory cap)."""
    need, sp, zero, mb, bits = smallest
    where = "the memory cap allows" if capped else f"{hw.name} has"
    return InfeasibleError(
        f"per-device memory binds: the smallest plan (sp_degree={sp}, zero_stage={zero}, "
        f"micro_batch={mb}, {bits}, lightest checkpointing) needs "
        f"{need / 2**30:.3g} GiB but {where} {limit / 2**30:.3g} GiB usable; "
        f"use more devices, a sequence shorter than {seq_len}, or a device with more memory")


def budget_infeasible(combos: Sequence[Combo], L: int, mem_cap: int, wall: float | None, budget: Budget,
                      devices: int, min_tokens: int) -> InfeasibleError:
    """The error of a solve whose every plan that fits memory costs more than the budget: names
    the budget (seconds per device under a time budget, FLOPs under a FLOP one) and the cheapest
    first token level (`min_tokens`, the fewest steps any plan runs) of a plan with every block
    on one entry that fits memory (`fits_uniform` in `mem_cap` units), with both numbers."""
    def q(v: float) -> int:
        return units(v, BYTES_PER_UNIT)

    needs = [(step_cost(c, {e: L}, L, wall, devices) * math.ceil(min_tokens / c.tokens_per_step), c, e)
             for c in combos for e in c.menu if fits_uniform(c, e, L, mem_cap, q)]
    cap = budget_cap(budget, wall)
    if wall is None:
        have = f"budget flops={cap:.4g} FLOPs"
    elif budget.device_hours is not None:
        have = (f"budget device_hours={budget.device_hours:g} gives {cap:.4g} s on each of {devices:,} "
                f"device(s)")
    else:
        have = f"budget wall_clock_s={cap:g} s"
    unit = "FLOPs" if wall is None else "s"
    if not needs:
        return InfeasibleError(f"compute budget binds: no plan with one checkpoint entry on every block fits "
                               f"memory and the {have}; raise the budget or shorten the sequence")
    need, c, e = min(needs, key=lambda t: t[0])
    err = InfeasibleError(
        f"compute budget binds: the cheapest plan that fits memory (sp_degree={c.choice.sp_degree}, "
        f"zero_stage={c.choice.zero_stage}, micro_batch={c.choice.micro_batch}, checkpoint {e}) needs "
        f"{need:.4g} {unit} for its first {math.ceil(min_tokens / c.tokens_per_step):,} step(s) of "
        f"{c.tokens_per_step:,} tokens but the {have}; raise the budget, use fewer devices (each gets "
        "more of a device-hour budget and less communication) or shorten the sequence")
    err.binding = "budget"
    return err
