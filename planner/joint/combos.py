"""The combos of the joint CP-SAT model (`trainplan.planner.joint.solver`) and their memory accounting.

A combo (`Combo`) is one assignment of the shape knobs (SP degree, ZeRO stage, micro-batch,
optimizer and saved-activation widths) as `trainplan.planner.joint.solver.solve_joint` builds it: its
memory terms (`ComboMemory`, bytes per device), the seconds per step outside the blocks
(`Combo.fixed_s`) and, per checkpoint entry of its menu, one block's retained / forward / backward
peak bytes, seconds per step and the step's FLOPs (`EntryCost`).

Memory is the one accounting `StepModel.evaluate` predicts (`trainplan.costmodels.step.memory.step_phases` over
`model_state_bytes(as_executed=True)`, FSDP2's `FsdpLayout` for ZeRO 2/3 on more than one
device, DDP's gradient buckets for ZeRO 0/1): `memory_rows` gives, for each checkpoint entry,
the highest bytes of the block forward and backward phases of the blocks on that entry (blocks
are identical and in `order`; the phases are linear in the block index, so the highest is at
the entry's first or last block), and `combo_memory` the phases that do not depend on the
checkpoint choice (head forward and backward, the root group's reduce-scatter, the optimizer
step). With exact bytes (`q=float`) the largest row or fixed phase is `evaluate`'s peak.

A combo with gradient accumulation (`Choice.grad_accum` > 1) prices one optimizer step of that
many micro-steps: seconds and FLOPs of the blocks times `grad_accum` (each micro-step runs every
block once), the rest as `StepModel.runtime` prices the whole optimizer step; memory holds the
accumulated gradients (`accumulated_grad_bytes`) in every phase of a later micro-step, into which
the new gradients are added in place (`trainplan.costmodels.step.memory.step_phases`): the rows are that
micro-step's, which bound the first micro-step's phase by phase (the gradients it has made at any
moment are at most those accumulated), so their largest is still `evaluate`'s peak.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainplan.costmodels.checkpoint_sets import CheckpointSet, resolve
from trainplan.costmodels.step.fsdp import FsdpLayout
from trainplan.costmodels.step.memory import RegionMemory
from trainplan.costmodels.step.model import Choice, StepModel
from trainplan.costmodels.step.offload import host_limit_bytes
from trainplan.planner.joint.space import SearchSpace

BYTES_PER_UNIT = 2**16          # memory in 64 KiB units


def units(value: float, per_unit: float) -> int:
    """`value` in whole units of `per_unit`, rounded up (the solver's integer coefficients)."""
    return int(math.ceil(value / per_unit))


@dataclass(frozen=True, kw_only=True, slots=True)
class ComboMemory:
    """The memory terms of one combo that do not depend on its checkpoint entries, bytes per
    device, as `StepModel.evaluate` composes them (`trainplan.costmodels.step.memory.step_phases`; built
    by `combo_memory`). Block i's backward holds `bwd_fixed_bytes` + `per_later_block_bytes` x
    (blocks after i) + `per_earlier_block_bytes` x (blocks before i) beyond `base_bytes`, the
    blocks' activations and its own backward peak."""

    base_bytes: float
    """Parameters and optimizer states at rest (`model_state_bytes(as_executed=True)`), the
    gradients accumulated across micro-steps (`accumulated_grad_bytes`, 0 without accumulation)
    and the head's retained activations: held in every block and tail phase."""
    fwd_unsharded_bytes: float
    """FSDP2's all-gathered parameters during a block's forward (ZeRO-3: the root group and the
    block's parameters and all-gather buffer; ZeRO-2: every group, whole); 0 without FSDP2."""
    tail_bytes: float
    """The tail's forward or backward peak (ZeRO-3: FSDP2's root group inside it,
    `StepModel.tail_memory`) plus the groups held whole then (ZeRO-2: all)."""
    bwd_fixed_bytes: float
    """Held in every block's backward: the tail's gradients (whole under FSDP2: the root group
    reduce-scatters last), FSDP2's whole groups at the first block and DDP's gradient buckets
    (all of them from the blocks' backward on, `trainplan.costmodels.step.memory.step_phases`)."""
    per_later_block_bytes: float
    """Held in a block's backward per block after it: that block's gradients (sharded by
    `grad_scale` once reduce-scattered)."""
    per_earlier_block_bytes: float
    """Held in a block's backward per block before it: FSDP2's whole groups (ZeRO-2: the root
    and blocks 0..i; ZeRO-3: the root, block i and the prefetched one)."""
    reduce_scatter_bytes: float
    """A block's gradient reduce-scatter buffers (`FsdpLayout.reduce_bytes`) less its own
    parameters, resharded before it (`FsdpLayout.at_reduce`): a phase beside its backward peak."""
    fixed_phase_bytes: dict[str, float]
    """The highest bytes of each phase that does not depend on the checkpoint entries, by phase
    kind (`fwd:head`, `bwd:head`, `bwd:root` under FSDP2, `optimizer`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EntryCost:
    """One checkpoint entry on one block of a combo (the blocks are identical), per device, as
    `StepModel.block_memory`, `block_time` and `block_cost` predict it at the combo's knobs."""

    entry: CheckpointSet
    """The checkpoint set blocks on this entry run."""
    retained_bytes: float
    """What one block holds from its forward to its backward (`RegionMemory.retained`)."""
    fwd_peak_bytes: float
    """One block's own forward peak (`RegionMemory.fwd_peak`)."""
    bwd_peak_bytes: float
    """One block's own backward peak, its recompute included (`RegionMemory.bwd_peak`; with
    accumulation, that of a later micro-step, `bwd_peak`)."""
    block_s: float
    """Seconds of one block per optimizer step: forward, backward, recompute and per-op overhead
    (`StepModel.block_time`) of one micro-step, times `grad_accum`."""
    step_flops: float
    """FLOPs of the whole optimizer step with every block on this entry: the unchecked step's
    plus every block's recompute FLOPs in each of its `grad_accum` micro-steps."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Combo:
    """One assignment of the shape knobs with what the joint model needs of it (module
    docstring): memory terms, fixed seconds and the cost of each entry of its checkpoint menu."""

    choice: Choice
    """The knobs, every block on `none`: SP degree, ZeRO stage, micro-batch, gradient
    accumulation, sequence, optimizer and saved-activation widths, devices."""
    memory: ComboMemory
    fixed_s: float
    """Seconds of one optimizer step outside the blocks: the unchecked step's less its blocks'."""
    menu: dict[str, EntryCost]
    """The checkpoint entries this combo may take, by name: the search space's named entries and,
    where its block shape's menu was added (`trainplan.planner.joint.remat_menu.add_menus`), solved
    `remat:k` entries."""

    @property
    def bits(self) -> tuple[int, int]:
        """(optimizer, saved-activation) widths, bits."""
        return self.choice.optimizer_bits, self.choice.activation_bits

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step over all data-parallel ranks, its micro-steps included."""
        c = self.choice
        return c.micro_batch * c.seq_len * (c.devices // c.sp_degree) * c.grad_accum

    def cost_of(self, e: str) -> EntryCost:
        """Entry `e`'s cost; an entry off this combo's menu reads as `full` (the solver holds its
        blocks at 0 under this combo; `full` is on every menu that has solved entries)."""
        return self.menu[e] if e in self.menu else self.menu["full"]


def micro_step(c: Choice) -> Choice:
    """`c` with one micro-step per optimizer step: what a block's bytes, seconds and FLOPs are
    asked at (the same in every micro-step)."""
    return c if c.grad_accum == 1 else dataclasses.replace(c, grad_accum=1)


def accumulated_grad_bytes(sm: StepModel, c: Choice) -> float:
    """Bytes per device of the gradients accumulated across `c`'s micro-steps: from the second
    micro-step on, every parameter's gradient at its width as the optimizer step holds it
    (`ModelStates.grads`: whole under DDP, which defers its all-reduce to the last micro-step
    with `no_sync`; sharded under FSDP2, which reduce-scatters every micro-step into the sharded
    gradient), held through every forward and backward phase of a later micro-step, the new
    gradients added into them in place (`trainplan.costmodels.step.memory.step_phases`). 0 with one
    micro-step."""
    return sm.model_states(c).grads if c.grad_accum > 1 else 0.0


def combo_memory(sm: StepModel, base: Choice) -> ComboMemory:
    """Memory terms of the combo whose knobs `base` fixes (its policies are ignored), bytes per
    device, as `StepModel.evaluate` composes them (`ComboMemory`'s fields); with accumulation, a
    later micro-step's (`accumulated_grad_bytes` in every phase before the optimizer step, the
    new gradients added into them: without FSDP2 no region's gradients are kept on top, under
    FSDP2 the blocks' shards are added and the root group's stay whole until its reduce-scatter)."""
    held = accumulated_grad_bytes(sm, base)
    base = micro_step(base)
    states = sm.model_states(base)
    L = len(sm.blocks)
    fsdp = sm.fsdp_layout(base)
    head = sm.head_memory(base)
    tail = sm.tail_memory(base)
    g = sm.block_memory(base, 0, "none").grad_bytes
    po = states.params + states.optimizer + held
    if fsdp is None:
        u_head = u_fwd = u_tail = u_b0 = u_b1 = u_end = rs = 0.0
        root_scale = states.grad_scale
    else:  # identical blocks: a block's forward holds the same, its backward one block more (ZeRO-2)
        u_head, fwd, u_tail, bwd, u_end = fsdp.unsharded(L)
        u_fwd, u_b0, u_b1 = fwd[0], bwd[0], (bwd[1] - bwd[0] if L > 1 else 0.0)
        # a block's reduce-scatter, its own parameters resharded first (`FsdpLayout.at_reduce`)
        root_scale, rs = 1.0, fsdp.reduce_bytes(g) + fsdp.at_reduce(L)[0] - bwd[0]
    if held:  # a later micro-step: the new gradients are added into the held ones
        root_scale = 1.0 if fsdp is not None else 0.0
    head_bwd, tail_bwd = (bwd_peak(m, held, fsdp) for m in (head, tail))
    buckets = states.comm_buffers  # DDP's: whole from the blocks' backward on (`step_phases`)
    tail_grads = tail.grad_bytes * root_scale
    G = 0.0 if held else g * states.grad_scale
    fixed = {"fwd:head": po + head.fwd_peak.total + u_head,
             "bwd:head": po + tail_grads + L * G + head_bwd + buckets + u_end,
             "optimizer": (states.params + states.grads + states.optimizer + states.comm_buffers
                           + states.optimizer_step_temp)}
    if fsdp is not None:  # the root group's reduce-scatter, the head's gradients still whole
        fixed["bwd:root"] = (po + L * G + head.grad_bytes
                             + fsdp.reduce_bytes(tail.grad_bytes + head.grad_bytes))
    # what the head hands the blocks (rotary tables, masks), from the blocks' forward to block
    # 0's backward (`trainplan.costmodels.step.memory.step_phases`)
    return ComboMemory(base_bytes=po + head.retained + sum(head.handed), fwd_unsharded_bytes=u_fwd,
                       tail_bytes=max(tail.fwd_peak.total, tail_bwd) + u_tail,
                       bwd_fixed_bytes=tail_grads + u_b0 + buckets,
                       per_later_block_bytes=G, per_earlier_block_bytes=u_b1,
                       reduce_scatter_bytes=rs, fixed_phase_bytes=fixed)


def bwd_peak(m: RegionMemory, held: float, fsdp: FsdpLayout | None) -> float:
    """A region's backward peak bytes in the micro-steps `combo_memory` prices: with gradients
    `held` from earlier micro-steps and no FSDP2, `RegionMemory.bwd_peak_accumulating`."""
    return (m.bwd_peak_accumulating if held and fsdp is None else m.bwd_peak).total


def entry_costs(sm: StepModel, base: Choice, sets: Mapping[str, CheckpointSet]) -> dict[str, EntryCost]:
    """The cost of each checkpoint entry of `sets` (name -> set) on one block at `base`'s knobs,
    per optimizer step (`EntryCost`)."""
    return _entry_costs(sm, base, sets, sm.runtime(base).flops)


def _entry_costs(sm: StepModel, base: Choice, sets: Mapping[str, CheckpointSet],
                 unchecked_flops: float) -> dict[str, EntryCost]:
    L, ga, one = len(sm.blocks), base.grad_accum, micro_step(base)
    held, fsdp = accumulated_grad_bytes(sm, base), sm.fsdp_layout(one)
    out = {}
    for e, entry in sets.items():
        mem = sm.block_memory(one, 0, entry)
        out[e] = EntryCost(entry=entry, retained_bytes=mem.retained, fwd_peak_bytes=mem.fwd_peak.total,
                           bwd_peak_bytes=bwd_peak(mem, held, fsdp), block_s=ga * sm.block_time(one, 0, entry),
                           step_flops=unchecked_flops + ga * L * sm.block_cost(one, 0, entry).recompute_flops)
    return out


def make_combo(sm: StepModel, base: Choice, sets: Mapping[str, CheckpointSet],
               memory: ComboMemory | None = None) -> Combo:
    """The combo of `base`'s knobs with the checkpoint menu `sets` (name -> set); `memory`:
    its `combo_memory`, when already computed. Seconds and FLOPs per optimizer step: the
    unchecked step's (`StepModel.runtime`, all `grad_accum` micro-steps) split into the blocks'
    (each micro-step's times `grad_accum`) and the rest (`fixed_s`). `fixed_s` holds the
    communication left exposed with no block checkpointed (`trainplan.costmodels.step.overlap`):
    recomputing hides more of it, so the joint model's seconds bound the plan's from above, by
    at most that exposed time; the plan's prediction is `StepModel.evaluate`'s."""
    unchecked = sm.runtime(base)
    menu = _entry_costs(sm, base, sets, unchecked.flops)
    blocks_s = len(sm.blocks) * base.grad_accum * sm.block_time(micro_step(base), 0, "none")
    fixed_s = unchecked.time_s - blocks_s
    return Combo(choice=base, memory=combo_memory(sm, base) if memory is None else memory,
                 fixed_s=fixed_s, menu=menu)


Rounding = Callable[[float], Any]
"""A memory term's rounding: `float` (exact bytes) or up to the solver's integer units."""


def memory_rows(c: Combo, order: Sequence[str], n: Mapping[str, Any],
                q: Rounding = float) -> Iterator[tuple[str, str | None, Any]]:
    """The per-device memory of combo c's phases that depend on the checkpoint counts, as
    (phase, entry, value): the tail (entry None, always in force), and per entry e the forward
    of its last block and the backward of its first and last (in force when `n[e]` >= 1).
    Blocks run in `order` (entries by retained bytes, smallest first: the early blocks hold
    theirs longest). `n`: blocks per entry, ints (value: bytes) or CP-SAT variables (a linear
    expression); `q`: each term's rounding, e.g. up to the solver's units."""
    m = c.memory
    R = {e: q(c.cost_of(e).retained_bytes) for e in order}
    base, G, Gb = q(m.base_bytes), q(m.per_later_block_bytes), q(m.per_earlier_block_bytes)
    yield "tail", None, base + sum(n[e] * R[e] for e in order) + q(m.tail_bytes)
    for k, e in enumerate(order):
        before = sum(n[x] * R[x] for x in order[:k])  # retained by the blocks before e's first
        nb = sum(n[x] for x in order[:k])
        na = sum(n[x] for x in order[k + 1:])  # blocks after e's last
        mine = before + (n[e] - 1) * R[e]  # retained before e's last block
        yield "fwd:block", e, base + q(m.fwd_unsharded_bytes) + mine + q(c.cost_of(e).fwd_peak_bytes)
        bwd = base + q(m.bwd_fixed_bytes) + q(max(c.cost_of(e).bwd_peak_bytes, m.reduce_scatter_bytes))
        yield "bwd:block", e, bwd + mine + (nb + n[e] - 1) * Gb + na * G
        yield "bwd:block", e, bwd + before + nb * Gb + (na + n[e] - 1) * G


def phase_peaks(c: Combo, counts: Mapping[str, int], order: Sequence[str]) -> dict[str, float]:
    """The highest bytes per device of each phase kind (`fwd:head`, `fwd:block`, `tail`,
    `bwd:block`, `bwd:head`, `bwd:root`, `optimizer`) of combo c with `counts` blocks per entry,
    exact: for the plan the solver returns, what `StepModel.evaluate` predicts, phase by phase."""
    out = dict(c.memory.fixed_phase_bytes)
    for phase, e, value in memory_rows(c, order, counts):
        if e is None or counts[e] > 0:
            out[phase] = max(out.get(phase, 0.0), value)
    return out


def fits_uniform(c: Combo, e: str, L: int, cap: float, q: Rounding = float) -> bool:
    """Whether every block on entry e fits `cap` (the checkpoint-dependent phases; the fixed
    ones fit every kept combo), in bytes, or in the solver's units with `q`."""
    return max(v for _, _, v in memory_rows(c, [e], {e: L}, q)) <= cap


def menu_targets(c: Combo, L: int, limit: float) -> tuple[float, float]:
    """(stacked peak, retained) caps, bytes, for one block with every block alike under `limit`:
    (L - 1) x retained + its own forward/backward peak, and retained bytes, that fit."""
    m = c.memory
    held = max(m.fwd_unsharded_bytes, m.bwd_fixed_bytes + (L - 1) * m.per_earlier_block_bytes)
    return limit - m.base_bytes - held, (limit - m.base_bytes - m.tail_bytes) / L

# ---- long-context variants ------------------------------------------------------------
# The long-context knobs in the joint model: for each combo of the shape knobs, its variants with
# a tiled loss, a tiled MLP and activation offload (`long_context_combos`), each a combo of its own
# (`trainplan.planner.joint.combos.Combo`) the CP-SAT model chooses among like any other.
#
# The knobs trade step time for memory (`trainplan.costmodels.step.model.Choice`): a tiled loss or MLP
# recomputes its chunks' forward in the backward, offload copies the checkpointed blocks' inputs to
# host memory and back. None of them makes a step faster. So a variant is added only where its
# plain combo does not fit with every block unchecked (`none`, the fastest entry): where it does,
# that plan is at least as fast as any variant's and uses the same tokens, bits and loss, and the
# variant can never win. This pruning is exact.
#
# When to search them (`SearchSpace.long_context_when_needed`): with the default values
# (`trainplan.planner.joint.space.default_tiling`) only when no combo without them fits memory with any
# checkpoint entry: each tiled variant is one more trace of its region, seconds for a large
# model (llama3-70b's tiled tail at 64 chunks, 2,786 ops, traces in about 5 s), which would
# otherwise be paid by every long-sequence solve, and a plan that fits without them never tiles
# or offloads. A plan that fits only by checkpointing its blocks may then run slower than one
# that would tile instead (e.g. an untiled `full` against a tiled MLP on `none`); values given
# to `solve` (`loss_chunks=`, `mlp_chunks=`, `offload=`) search the variants wherever they may
# pay.
#
# Menus: a tiled MLP runs under `none` or `full` only (`Choice.mlp_chunks`); offload acts on
# checkpointed blocks, so its combos keep the named entries (those on `none` move nothing).
# An offload variant is dropped when the inputs of all its blocks would not fit the device's share
# of host memory (`trainplan.costmodels.step.offload.host_limit_bytes`): the plan's own host bytes are
# at most that.

MLP_TILED_ENTRIES = ("none", "full")
"""The checkpoint entries a block with a tiled MLP may take (`Choice.mlp_chunks`)."""


def long_context_combos(sm: StepModel, plain: Combo, space: SearchSpace, named: Sequence[str],
                        limit: float) -> list[Combo]:
    """The variants of combo `plain` (no tiling, no offload) over the space's `loss_chunks`,
    `mlp_chunks` and `offload` values (module docstring): none where `plain` fits `limit` with
    every block on `none`, or where a variant's menu would be empty."""
    L = len(sm.blocks)
    if "none" in plain.menu and fits_uniform(plain, "none", L, limit):
        return []
    c0 = plain.choice
    tokens = c0.micro_batch * c0.seq_len // c0.sp_degree  # a micro-batch's tokens on one rank
    out = []
    for lc, mc, off in itertools.product(space.loss_chunks, space.mlp_chunks, space.offload):
        if (lc, mc, off) == (1, 1, False) or max(lc, mc) > tokens:  # more chunks than tokens: none
            continue
        entries = [e for e in named if mc == 1 or e in MLP_TILED_ENTRIES]
        if not entries or (off and not any(resolve(e).checkpointed for e in entries)):
            continue
        choice = dataclasses.replace(plain.choice, loss_chunks=lc, mlp_chunks=mc, offload=off)
        if off and not sm.hw.unified_memory and L * _input_bytes(sm, choice) > host_limit_bytes(sm.hw):
            continue
        out.append(make_combo(sm, choice, {e: resolve(e) for e in entries}))
    return out


def _input_bytes(sm: StepModel, c) -> float:
    """Bytes of one block's input at `c` (what offload moves per block)."""
    return sm.block_memory(dataclasses.replace(c, grad_accum=1), 0, "full").input_bytes
