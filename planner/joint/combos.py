"""Per-combo helpers of the joint CP-SAT model (`planner.joint.solver`): the model's units, the
compute constraint's terms, dominated combos, a feasible start, and spending the budget.

A combo is one assignment of the shape knobs (SP degree, ZeRO stage, micro-batch, optimizer
bits) as `planner.joint.solver.solve_joint` builds it: a dict of memory terms (`combo_memory`: bytes
per device), seconds (`fixed_s`), per checkpoint entry retained / forward / backward peak
bytes (`R`, `F`, `T`), seconds (`block_s`) and the step's FLOPs (`flops`), and its menu `sets`.

Memory is the one accounting `StepModel.evaluate` predicts (`costmodels.step.memory.step_phases` over
`model_state_bytes(as_executed=True)`, FSDP2's `FsdpLayout` for ZeRO 2/3 on more than one
device, DDP's gradient buckets for ZeRO 0/1): `memory_rows` gives, for each checkpoint entry,
the highest bytes of the block forward and backward phases of the blocks on that entry (blocks
are identical and in `order`; the phases are linear in the block index, so the highest is at
the entry's first or last block), and `combo_memory` the phases that do not depend on the
checkpoint choice (head forward and backward, the root group's reduce-scatter, the optimizer
step). With exact bytes (`q=float`) the largest row or fixed phase is `evaluate`'s peak.
"""

from __future__ import annotations

import math

from costmodels.step.model import Choice, StepModel
from hardware_profiles import HardwareProfile
from planner.budget import Budget
from trainplan_errors import InfeasibleError

BYTES_PER_UNIT = 2**16          # memory in 64 KiB units
MICROS_PER_UNIT = 1e-6          # time in microseconds


def units(value: float, per_unit: float) -> int:
    return int(math.ceil(value / per_unit))


def combo_memory(sm: StepModel, base: Choice) -> dict:
    """Memory terms of the combo whose knobs `base` fixes (its policies are ignored), bytes per
    device, as `StepModel.evaluate` composes them (`costmodels.step.memory.step_phases`):

    - `base`: parameters and optimizer states at rest (`model_state_bytes(as_executed=True)`)
      and the head's retained activations: held in every block and tail phase;
    - `unsharded`: FSDP2's all-gathered parameters during a block's forward (ZeRO-3: the root
      group and the block's parameters and all-gather buffer; ZeRO-2: every group, whole);
    - `tail`: the tail's forward or backward peak (ZeRO-3: FSDP2's root group inside it,
      `StepModel.tail_memory`) plus the groups held whole then (ZeRO-2: all);
    - `bwd_fixed`, `G`, `Gb`: block i's backward holds `bwd_fixed` + `G` x (blocks after i) +
      `Gb` x (blocks before i) beyond `base`, its activations and its own backward peak:
      the tail's gradients (whole under FSDP2: the root group reduce-scatters last), the
      later blocks' gradients (sharded by `grad_scale` once reduce-scattered), DDP's buckets
      (filled in proportion to the gradients made) and FSDP2's whole groups (ZeRO-2: the
      root and blocks 0..i; ZeRO-3: the root, block i and the prefetched one);
    - `rs`: a block's gradient reduce-scatter buffers (`FsdpLayout.reduce_bytes`) less its own
      parameters, resharded before it (`FsdpLayout.at_reduce`), a phase beside its backward peak;
    - `fixed`: the highest bytes of each phase that does not depend on the checkpoint entries
      (`fwd:head`, `bwd:head`, `bwd:root`, `optimizer`)."""
    states = sm.model_states(base)
    L = len(sm.blocks)
    fsdp = sm.fsdp_layout(base)
    head = sm.head_memory(base)
    tail = sm.tail_memory(base)
    g = sm.block_memory(base, 0, "none").grad_bytes
    po = states.params + states.optimizer
    if fsdp is None:
        u_head = u_fwd = u_tail = u_b0 = u_b1 = u_end = rs = 0.0
        root_scale = states.grad_scale
    else:  # identical blocks: a block's forward holds the same, its backward one block more (ZeRO-2)
        u_head, fwd, u_tail, bwd, u_end = fsdp.unsharded(L)
        u_fwd, u_b0, u_b1 = fwd[0], bwd[0], (bwd[1] - bwd[0] if L > 1 else 0.0)
        # a block's reduce-scatter, its own parameters resharded first (`FsdpLayout.at_reduce`)
        root_scale, rs = 1.0, fsdp.reduce_bytes(g) + fsdp.at_reduce(L)[0] - bwd[0]
    total_grads = tail.grad_bytes + L * g + head.grad_bytes
    bucket = states.comm_buffers / total_grads if total_grads else 0.0  # per gradient byte made
    tail_grads = tail.grad_bytes * root_scale
    G = g * states.grad_scale
    fixed = {"fwd:head": po + head.fwd_peak.total + u_head,
             "bwd:head": (po + tail_grads + L * G + head.bwd_peak.total
                          + (states.comm_buffers if total_grads else 0.0) + u_end),
             "optimizer": (states.params + states.grads + states.optimizer + states.comm_buffers
                           + states.optimizer_step_temp)}
    if fsdp is not None:  # the root group's reduce-scatter, the head's gradients still whole
        fixed["bwd:root"] = (po + L * G + head.grad_bytes
                             + fsdp.reduce_bytes(tail.grad_bytes + head.grad_bytes))
    return dict(base=po + head.retained, unsharded=u_fwd,
                tail=max(tail.fwd_peak.total, tail.bwd_peak.total) + u_tail,
                bwd_fixed=tail_grads + u_b0 + bucket * (tail.grad_bytes + g),
                G=G + bucket * g, Gb=u_b1, rs=rs, fixed=fixed)


def memory_rows(c: dict, order: list[str], n: dict, q=float):
    """The per-device memory of combo c's phases that depend on the checkpoint counts, as
    (phase, entry, value): the tail (entry None, always in force), and per entry e the forward
    of its last block and the backward of its first and last (in force when `n[e]` >= 1).
    Blocks run in `order` (entries by retained bytes, smallest first: the early blocks hold
    theirs longest). `n`: blocks per entry, ints (value: bytes) or CP-SAT variables (a linear
    expression); `q`: each term's rounding, e.g. up to the solver's units."""
    R = {e: q(c["R"][e]) for e in order}
    base, G, Gb = q(c["base"]), q(c["G"]), q(c["Gb"])
    yield "tail", None, base + sum(n[e] * R[e] for e in order) + q(c["tail"])
    for k, e in enumerate(order):
        before = sum(n[x] * R[x] for x in order[:k])  # retained by the blocks before e's first
        nb = sum(n[x] for x in order[:k])
        na = sum(n[x] for x in order[k + 1:])  # blocks after e's last
        mine = before + (n[e] - 1) * R[e]  # retained before e's last block
        yield "fwd:block", e, base + q(c["unsharded"]) + mine + q(c["F"][e])
        bwd = base + q(c["bwd_fixed"]) + q(max(c["T"][e], c["rs"]))
        yield "bwd:block", e, bwd + mine + (nb + n[e] - 1) * Gb + na * G
        yield "bwd:block", e, bwd + before + nb * Gb + (na + n[e] - 1) * G


def phase_peaks(c: dict, counts: dict, order: list[str]) -> dict[str, float]:
    """The highest bytes per device of each phase kind (`fwd:head`, `fwd:block`, `tail`,
    `bwd:block`, `bwd:head`, `bwd:root`, `optimizer`) of combo c with `counts` blocks per entry,
    exact: for the plan the solver returns, what `StepModel.evaluate` predicts, phase by phase."""
    out = dict(c["fixed"])
    for phase, e, value in memory_rows(c, order, counts):
        if e is None or counts[e] > 0:
            out[phase] = max(out.get(phase, 0.0), value)
    return out


def fits_uniform(c: dict, e: str, L: int, cap: float, q=float) -> bool:
    """Whether every block on entry e fits `cap` (the checkpoint-dependent phases; the fixed
    ones fit every kept combo), in bytes, or in the solver's units with `q`."""
    return max(v for _, _, v in memory_rows(c, [e], {e: L}, q)) <= cap


def menu_targets(c: dict, L: int, limit: float) -> tuple[float, float]:
    """(stacked peak, retained) caps for one block with every block alike under `limit`:
    (L - 1) x retained + its own forward/backward peak, and retained bytes, that fit."""
    held = max(c["unsharded"], c["bwd_fixed"] + (L - 1) * c["Gb"])
    return limit - c["base"] - held, (limit - c["base"] - c["tail"]) / L


_SHAPE = ("base", "tail", "unsharded", "bwd_fixed", "G", "Gb", "rs", "fixed_s")
_PER_ENTRY = ("R", "F", "T", "block_s", "flops")


def undominated(combos: list[dict]) -> list[dict]:
    """Drop each combo another beats or ties everywhere: the same tokens per step and optimizer
    width, every checkpoint entry of its menu on the other's too, and no more bytes, seconds or
    FLOPs in any term of the model (e.g. ZeRO-1 against ZeRO-2, whose communication the model
    prices alike). Exact: the solver's optimum is unchanged. Of equal combos the first stays."""
    def le(a: dict, b: dict) -> bool:
        return (a["tokens_per_step"] == b["tokens_per_step"] and a["bits"] == b["bits"]
                and all(e in a["sets"] for e in b["sets"])
                and all(a[k] <= b[k] for k in _SHAPE)
                and all(a[k][e] <= b[k][e] for k in _PER_ENTRY for e in b["sets"]))

    keep = []
    for i, c in enumerate(combos):
        if not any(le(o, c) and (j < i or not le(c, o)) for j, o in enumerate(combos) if j != i):
            keep.append(c)
    return keep


def prune_narrower(combos: list[dict], L: int, mem_cap: int, bits_pen: dict, wall) -> list[dict]:
    """Drop each combo that another of the same SP degree, ZeRO stage and micro-batch beats at
    its fastest: a width of no more loss penalty (`bits_pen`) whose plan with every block
    unchecked (`none`, no recompute) fits memory (`mem_cap`, in the solver's rounded units) at no
    more cost per step (seconds, or FLOPs under a FLOP budget) than this combo's own all-`none`
    plan, which is the cheapest it can run. Exact: lower bits only pay where memory binds."""
    if any("none" not in c["sets"] for c in combos):
        return combos

    def cost(c: dict) -> float:
        return c["fixed_s"] + L * c["block_s"]["none"] if wall is not None else c["flops"]["none"]

    def fits_unchecked(c: dict) -> bool:
        return all(v <= mem_cap for _, _, v in memory_rows(c, ["none"], {"none": L},
                                                           lambda v: units(v, BYTES_PER_UNIT)))
    shape = lambda c: (c["sp"], c["zero"], c["mb"])  # noqa: E731
    free = [c for c in combos if fits_unchecked(c)]
    keep = []
    for c in combos:
        beaten = any(shape(o) == shape(c) and o is not c and bits_pen[o["bits"]] <= bits_pen[c["bits"]]
                     and cost(o) <= cost(c) and (bits_pen[o["bits"]] < bits_pen[c["bits"]] or cost(o) < cost(c)
                                                 or o["bits"] > c["bits"])
                     for o in free)
        if not beaten:
            keep.append(c)
    return keep


def step_cost(c: dict, counts: dict, L: int, wall, devices: int) -> float:
    """One step's cost: seconds under a time budget, FLOPs over all devices under a FLOP one."""
    if wall is not None:
        return c["fixed_s"] + sum(counts[e] * c["block_s"][e] for e in counts)
    return sum(counts[e] * c["flops"][e] for e in counts) / L * devices


def spent(c, counts, L, wall, budget, devices, law, n_params, f, data_tokens, level, bits_pen):
    """(predicted loss, steps) when the whole budget is spent at these knobs (the levels are a
    grid; loss falls with tokens), at least the level's steps."""
    cap = wall if wall is not None else budget.flops
    steps = max(math.ceil(level / c["tokens_per_step"]), int(cap // step_cost(c, counts, L, wall, devices)), 1)
    return (law.predict(n_params, steps * c["tokens_per_step"], unique_tokens=max(1.0, f * data_tokens))
            + bits_pen[c["bits"]], steps)


def budget_terms(c: dict, entries, L: int, wall, budget: Budget, devices: int):
    """The compute constraint's terms for combo c: (cost per step of one block on each entry,
    fixed cost per step, the cap, the integer unit): seconds under a time budget, FLOPs over
    all devices under a FLOP budget."""
    if wall is not None:
        return {e: c["block_s"][e] for e in entries}, c["fixed_s"], wall, MICROS_PER_UNIT
    return {e: c["flops"][e] / L * devices for e in entries}, 0.0, budget.flops, budget.flops / 1e9


def uniform_start(combos, entries, L, mem_cap, levels, fractions, terms, loss):
    """A feasible start for the solver: the (combo index, entry, level, fraction) of the lowest
    predicted loss with every block on one entry that fits memory (`fits_uniform` in the
    solver's units: `mem_cap`) and the budget at that level, or None."""
    q = lambda v: units(v, BYTES_PER_UNIT)  # noqa: E731
    best = None
    for i, c in enumerate(combos):
        per_step, fixed_cost, cap, scale = terms(c)
        for e in entries:
            if e not in c["sets"] or not fits_uniform(c, e, L, mem_cap, q):
                continue
            fits = [k for k, t in enumerate(levels)
                    if L * units(math.ceil(t / c["tokens_per_step"]) * per_step[e], scale)
                    + units(math.ceil(t / c["tokens_per_step"]) * fixed_cost, scale) <= int(cap / scale)]
            if not fits:
                continue
            for fr in fractions:
                key = (loss(fits[-1], fr, c["bits"]), -fr)
                if best is None or key < best[0]:
                    best = (key, (i, e, fits[-1], fr))
    return None if best is None else best[1]


def lightest_uniform(sm: StepModel, combos: list[Choice], named: list[str]) -> tuple:
    """(bytes, sp, zero, micro-batch, bits) of the lightest uniform plan over `combos`."""
    best = None
    for base in combos:
        for e in named:
            c = Choice(**{**_fields(base), "policies": (e,) * len(sm.blocks)})
            need = sm.evaluate(c).memory.total
            if best is None or need < best[0]:
                best = (need, base.sp_degree, base.zero_stage, base.micro_batch,
                        f"{base.optimizer_bits}-bit optimizer, {base.activation_bits}-bit saved activations")
    return best


def _fields(c: Choice) -> dict:
    return {f: getattr(c, f) for f in c.__slots__}


def memory_infeasible(smallest, limit: float, hw: HardwareProfile, seq_len: int,
                       capped: bool) -> InfeasibleError:
    need, sp, zero, mb, bits = smallest
    where = "the memory cap allows" if capped else f"{hw.name} has"
    return InfeasibleError(
        f"per-device memory binds: the smallest plan (sp_degree={sp}, zero_stage={zero}, "
        f"micro_batch={mb}, {bits}, lightest checkpointing) needs "
        f"{need / 2**30:.3g} GiB but {where} {limit / 2**30:.3g} GiB usable; "
        f"use more devices, a sequence shorter than {seq_len}, or a device with more memory")
