"""The joint CP-SAT model: every knob of a Plan in one OR-Tools model.

Written in the OR-Tools sample order: data, variables, constraints, objective, solve, read
the solution. The cost models are nonlinear in the knobs (activation bytes scale with
micro-batch x sequence / SP degree; time with the checkpoint mix), so the model enumerates
the small product of discrete "shape" knobs as one-hot `combo` literals and keeps everything
linear given a combo: the checkpoint choice is a count of blocks per menu entry (identical
blocks are interchangeable), the stopping budget a one-hot over geometric token levels, the
data fraction a one-hot, and the objective a table lookup of the scaling law.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

from ortools.sat.python import cp_model

from costmodels import comm
from costmodels.loss import LossLaw, bits_loss_penalty
from costmodels.memory import model_state_bytes
from costmodels.remat import BUILTIN, MENU, resolve
from costmodels.step import PRECISIONS, Choice, StepModel
from hardware_profiles import HardwareProfile
from hardware_profiles.errors import InfeasibleError
from planner.budget import Budget
from planner.remat import add_menus, by_recompute, entry_numbers, menu_index, named_entries

BYTES_PER_UNIT = 2**16          # memory in 64 KiB units
MICROS_PER_UNIT = 1e-6          # time in microseconds
LOSS_PER_UNIT = 1e-5            # objective resolution, nats
TOKEN_LEVELS = 48
POLISH_LEVELS = 10**6            # resolution of the step cost in the polish solve
POLISH_TIME_S = 1.0
DEFAULT_POLICIES = ("none", "save_matmuls", "save_attention", "full", MENU)
"""Checkpoint menu: the built-in entries plus each block shape's solved Pareto menu."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchSpace:
    """Values each knob may take."""

    sp_degrees: tuple[int, ...]
    zero_stages: tuple[int, ...]
    micro_batches: tuple[int, ...]
    policies: tuple[str, ...]
    optimizer_bits: tuple[int, ...]
    data_fractions: tuple[float, ...]
    precision: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Solution:
    choice: Choice
    data_fraction: float
    total_tokens: int
    max_steps: int
    tokens_per_step: int
    predicted_loss: float
    status: str
    objective: float
    bound: float
    wall_s: float
    n_variables: int
    n_constraints: int


def default_space(*, devices: int, seq_len: int, n_heads: int, n_kv_heads: int,
                  precision: str, micro_batches=(1, 2, 4, 8, 16), optimizer_bits=(32, 8),
                  policies=DEFAULT_POLICIES, data_fractions=(0.25, 0.5, 0.75, 1.0)) -> SearchSpace:
    """The search space for `devices` devices: SP degrees that divide the device count, the
    heads and the sequence; ZeRO stages 0-3 when there is more than one device."""
    sps = tuple(p for p in comm.valid_sp_degrees(seq_len, n_heads, n_kv_heads) if devices % p == 0)
    return SearchSpace(sp_degrees=sps, zero_stages=(0, 1, 2, 3) if devices > 1 else (0,),
                       micro_batches=tuple(micro_batches), policies=tuple(policies),
                       optimizer_bits=tuple(optimizer_bits), data_fractions=tuple(data_fractions),
                       precision=precision)


def solve_joint(step_model: StepModel, hw: HardwareProfile, budget: Budget, *, seq_len: int,
                space: SearchSpace, n_params: int, data_tokens: int, law: LossLaw,
                memory_limit_bytes: float | None = None, time_limit_s: float = 10.0, seed: int = 0,
                workers: int = 2,
                export_path: str | None = None) -> Solution:
    """Choose all knobs jointly to minimise predicted final loss, ties broken by cost.

    Raises:
        InfeasibleError: nothing fits memory, or the budget buys no step; the message names the
            binding term with both numbers and what to relax.
    """
    t0 = time.perf_counter()
    # ---- data -------------------------------------------------------------------------
    devices = budget.devices
    L = len(step_model.blocks)
    limit = hw.usable_bytes if memory_limit_bytes is None else min(memory_limit_bytes, hw.usable_bytes)
    named = named_entries(space.policies)
    combos, dropped = [], []
    for sp, zero, mb, bits in itertools.product(space.sp_degrees, space.zero_stages,
                                                space.micro_batches, space.optimizer_bits):
        base = Choice(sp_degree=sp, zero_stage=zero, micro_batch=mb, seq_len=seq_len,
                      policies=("none",) * L, precision=space.precision, optimizer_bits=bits,
                      devices=devices)
        wb, gb, mb_bytes, _ = PRECISIONS[space.precision]
        states = model_state_bytes(step_model.param_numels, weight_bytes=wb, grad_bytes=gb,
                                   master_bytes=mb_bytes, optimizer_bits=bits, zero_stage=zero,
                                   shard_degree=devices, foreach=hw.device_type != "cpu")
        head = step_model._mem("head", mb, seq_len // sp, "none")
        tail = step_model._mem("tail", mb, seq_len // sp, "none")
        grad_bytes = step_model.block_memory(base, 0, "none").grad_bytes
        opt_peak = (states.params + states.grads + states.optimizer + states.optimizer_step_temp
                    + states.comm_buffers)
        head_bwd = (states.params + states.optimizer + states.comm_buffers
                    + (tail.grad_bytes + L * grad_bytes) * states.grad_scale
                    + head.bwd_peak.total)
        if max(opt_peak, head_bwd) > limit:
            dropped.append(base)
            continue
        c = dict(sp=sp, zero=zero, mb=mb, bits=bits,
                 base=states.params + states.optimizer + states.comm_buffers + head.retained,  # buckets: bound
                 tail=max(tail.fwd_peak.total, tail.bwd_peak.total),
                 tail_grads=tail.grad_bytes * states.grad_scale,
                 unsharded=step_model.unsharded_bytes(base), G=grad_bytes * states.grad_scale,
                 tokens_per_step=mb * seq_len * (devices // sp))
        c.update(entry_numbers(step_model, base, {e: resolve(e) for e in named}), choice=base)
        combos.append(c)
    if not combos:
        raise _memory_infeasible(_smallest(step_model, dropped, named), limit, hw, seq_len,
                                 capped=memory_limit_bytes is not None)
    if MENU in space.policies:
        add_menus(step_model, combos, named, limit)
    # checkpoint entries: the named ones, then solved `remat:k` (absent from a combo's menu: 0 blocks)
    entries = named + sorted({e for c in combos for e in c["sets"]} - set(named), key=menu_index)
    for c in combos:
        for e in entries:
            if e not in c["sets"]:
                for key in ("R", "F", "T", "block_s", "flops"):
                    c[key][e] = c[key]["full"]
    # token levels: from one step of the smallest batch to the most the budget could buy
    best_rate = max(c["tokens_per_step"] / (c["fixed_s"] + L * min(c["block_s"].values()))
                    for c in combos)
    wall = budget.wall_s_for(devices)
    if wall is not None:
        max_tokens = best_rate * wall
    else:
        max_tokens = max(c["tokens_per_step"] / (min(c["flops"].values()) * devices) for c in combos) * budget.flops
    min_tokens = min(c["tokens_per_step"] for c in combos)
    if max_tokens < min_tokens:
        raise InfeasibleError(
            f"budget {budget.kind}={getattr(budget, budget.kind):g} buys less than one step: the "
            f"fastest plan needs {min_tokens / best_rate:.3g} s per step on {devices} device(s); "
            "raise the budget or shorten the sequence")
    levels = sorted({int(min_tokens * (max_tokens / min_tokens) ** (k / (TOKEN_LEVELS - 1)))
                     for k in range(TOKEN_LEVELS)})
    bits_pen = {b: bits_loss_penalty(b) for b in space.optimizer_bits}
    loss = {(k, f): law.predict(n_params, levels[k], unique_tokens=max(1.0, f * data_tokens))
            for k in range(len(levels)) for f in space.data_fractions}

    # ---- variables --------------------------------------------------------------------
    m = cp_model.CpModel()
    z = [m.new_bool_var(f"combo_sp{c['sp']}_z{c['zero']}_mb{c['mb']}_b{c['bits']}") for c in combos]  # shape knobs
    n = {e: m.new_int_var(0, L, f"blocks_{e}") for e in entries}  # blocks per checkpoint entry
    y = [m.new_bool_var(f"tokens_{t}") for t in levels]  # stopping budget level
    x = {f: m.new_bool_var(f"fraction_{f}") for f in space.data_fractions}  # data fraction
    w = {kf: m.new_bool_var(f"loss_{kf[0]}_{kf[1]}") for kf in loss}  # y_k AND x_f

    # ---- constraints ------------------------------------------------------------------
    m.add_exactly_one(z)
    m.add_exactly_one(y)
    m.add_exactly_one(x.values())
    m.add(sum(n.values()) == L)  # [Constraint] every block has one checkpoint entry
    for (k, f), v in w.items():
        m.add_implication(v, y[k])
        m.add_implication(v, x[f])
    m.add_exactly_one(w.values())
    u = {e: m.new_bool_var(f"uses_{e}") for e in entries}  # some block takes entry e
    for e in entries:
        m.add(n[e] >= u[e])
        m.add(n[e] <= L * u[e])
    mem_cap = int(limit // BYTES_PER_UNIT)
    for zc, c in zip(z, combos):
        # [Constraint] per-device memory <= HBM - reserve, at every phase of the step. Blocks are
        # ordered by retained bytes (smallest first: early blocks hold theirs longest), so the
        # bytes before and after the last / first block of entry e are linear in the counts.
        for e in entries:  # [Constraint] only entries on this combo's menu
            if e not in c["sets"]:
                m.add(n[e] == 0).only_enforce_if(zc)
        order = sorted(entries, key=lambda e: c["R"][e])
        mib = lambda v: _units(v, BYTES_PER_UNIT)  # noqa: E731
        held = {e: n[e] * mib(c["R"][e]) for e in order}
        m.add(mib(c["base"]) + sum(held.values()) + mib(c["tail"]) <= mem_cap).only_enforce_if(zc)
        for k, e in enumerate(order):
            before = sum(held[x] for x in order[:k])
            after = sum(n[x] for x in order[k + 1:])
            fixed = mib(c["base"]) + mib(c["unsharded"])
            last_e = before + (n[e] - 1) * mib(c["R"][e])
            grads_after = mib(c["tail_grads"]) + after * mib(c["G"])
            m.add(fixed + last_e + mib(c["F"][e]) <= mem_cap).only_enforce_if([zc, u[e]])
            m.add(fixed + last_e + grads_after + mib(c["T"][e]) <= mem_cap).only_enforce_if([zc, u[e]])
            m.add(fixed + before + grads_after + (n[e] - 1) * mib(c["G"]) + mib(c["T"][e])
                  <= mem_cap).only_enforce_if([zc, u[e]])
        # [Constraint] compute <= budget, at each token level
        for k, tokens in enumerate(levels):
            steps = math.ceil(tokens / c["tokens_per_step"])
            if wall is not None:
                per_step = {e: c["block_s"][e] for e in n}
                fixed_cost, cap = c["fixed_s"], wall
                scale = MICROS_PER_UNIT
            else:
                per_step = {e: c["flops"][e] / L * devices for e in n}
                fixed_cost, cap, scale = 0.0, budget.flops, budget.flops / 1e9
            m.add(sum(n[e] * _units(steps * per_step[e], scale) for e in n)
                  + _units(steps * fixed_cost, scale) <= int(cap / scale)).only_enforce_if([zc, y[k]])

    # ---- objective: lowest predicted loss, then fewest device-seconds ------------------
    loss_terms = [v * int(round((loss[kf]) / LOSS_PER_UNIT)) for kf, v in w.items()]
    pen_terms = [zc * int(round(bits_pen[c["bits"]] / LOSS_PER_UNIT)) for zc, c in zip(z, combos)]
    # ties, in order: fewer tokens (cost), more of the corpus (a random subset never helps),
    # less recompute (entries ranked from least to most recomputing; the polish below then
    # takes the cheapest blocks at the chosen knobs)
    fr_rank = {f: i for i, f in enumerate(sorted(space.data_fractions, reverse=True))}
    remat_rank = [n[e] * i for i, e in enumerate(by_recompute(entries))]
    w_remat = (len(entries) - 1) * L + 1
    tie_terms = [y[k] * k * len(fr_rank) for k in range(len(levels))] + [v * fr_rank[f] for f, v in x.items()]
    w_ties = (len(levels) + 1) * len(fr_rank) * w_remat
    m.minimize(w_ties * (sum(loss_terms) + sum(pen_terms)) + w_remat * sum(tie_terms) + sum(remat_rank))
    # hint: the plain plan (no checkpointing, largest fitting batch) is a natural start
    m.add_hint(n[entries[0]], L)

    # ---- solve ------------------------------------------------------------------------
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.random_seed = seed
    solver.parameters.num_workers = workers
    if export_path:
        m.export_to_file(export_path)
    status = solver.solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise InfeasibleError(
            f"no plan fits the budget {budget.to_dict()} (solver status {solver.status_name(status)}); "
            "raise the budget, add devices or shorten the sequence")

    # ---- read the solution ------------------------------------------------------------
    ci = next(i for i, v in enumerate(z) if solver.value(v))
    c = combos[ci]
    k = next(i for i, v in enumerate(y) if solver.value(v))
    f = next(fr for fr, v in x.items() if solver.value(v))
    counts = {e: solver.value(n[e]) for e in n}
    objective, bound, status_name = solver.objective_value, solver.best_objective_bound, solver.status_name(status)
    n_variables, n_constraints = len(m.proto.variables), len(m.proto.constraints)
    # ---- polish: the token levels are a grid, so at the chosen token level and data fraction
    # (and optimizer bits: the same loss) take the combo and entries with the least cost per
    # token (seconds under a time budget, FLOPs under a FLOP budget)
    def per_token(c2: dict) -> tuple[float, dict]:
        if wall is not None:
            return c2["fixed_s"] / c2["tokens_per_step"], {e: c2["block_s"][e] / c2["tokens_per_step"] for e in entries}
        return 0.0, {e: c2["flops"][e] / L / c2["tokens_per_step"] for e in entries}

    costs = [per_token(c2) for c2 in combos]
    unit = max(fx + L * max(bl.values()) for fx, bl in costs) / POLISH_LEVELS
    m.add(y[k] == 1)
    m.add(x[f] == 1)
    token_cost = m.new_int_var(0, POLISH_LEVELS + L + 1, "cost_per_token")  # units of `unit`
    for zc, c2, (fx, bl) in zip(z, combos, costs):
        if c2["bits"] != c["bits"]:
            m.add(zc == 0)
            continue
        m.add(token_cost >= _units(fx, unit) + sum(n[e] * _units(bl[e], unit) for e in entries)
              ).only_enforce_if(zc)
    m.minimize(token_cost)
    m.clear_hints()
    for e in entries:
        m.add_hint(n[e], counts[e])
    for i, zc in enumerate(z):
        m.add_hint(zc, i == ci)
    solver.parameters.max_time_in_seconds = min(time_limit_s, POLISH_TIME_S)
    if solver.solve(m) in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        c = combos[next(i for i, v in enumerate(z) if solver.value(v))]
        counts = {e: solver.value(n[e]) for e in n}
    # most-saving entries on the earliest blocks: their activations live the longest
    order = sorted(entries, key=lambda e: c["R"][e])
    policies = tuple(e for e in order for _ in range(counts[e]))
    choice = Choice(sp_degree=c["sp"], zero_stage=c["zero"], micro_batch=c["mb"], seq_len=seq_len,
                    policies=policies, precision=space.precision, optimizer_bits=c["bits"],
                    devices=devices,
                    sets=tuple(c["sets"][e] for e in entries if counts[e] and e not in BUILTIN))
    # the levels are a grid: spend the whole budget at the chosen knobs (loss falls with tokens)
    if wall is not None:
        step_cost = c["fixed_s"] + sum(counts[e] * c["block_s"][e] for e in counts)
        affordable = int(wall // step_cost)
    else:
        affordable = int(budget.flops // (sum(counts[e] * c["flops"][e] for e in counts) / L * devices))
    steps = max(math.ceil(levels[k] / c["tokens_per_step"]), affordable, 1)
    return Solution(choice=choice, data_fraction=f, total_tokens=steps * c["tokens_per_step"],
                    max_steps=steps, tokens_per_step=c["tokens_per_step"],
                    predicted_loss=law.predict(n_params, steps * c["tokens_per_step"],
                                               unique_tokens=max(1.0, f * data_tokens)) + bits_pen[c["bits"]],
                    status=status_name, objective=objective,
                    bound=bound, wall_s=time.perf_counter() - t0,
                    n_variables=n_variables, n_constraints=n_constraints)


def _smallest(sm: StepModel, combos: list[Choice], named: list[str]) -> tuple:
    """(bytes, sp, zero, micro-batch, bits) of the lightest uniform plan over `combos`."""
    best = None
    for base in combos:
        for e in named:
            c = Choice(**{**_fields(base), "policies": (e,) * len(sm.blocks)})
            need = sm.evaluate(c).memory.total
            if best is None or need < best[0]:
                best = (need, base.sp_degree, base.zero_stage, base.micro_batch, base.optimizer_bits)
    return best


def _fields(c: Choice) -> dict:
    return {f: getattr(c, f) for f in c.__slots__}


def _units(value: float, per_unit: float) -> int:
    return int(math.ceil(value / per_unit))


def _memory_infeasible(smallest, limit: float, hw: HardwareProfile, seq_len: int,
                       capped: bool) -> InfeasibleError:
    need, sp, zero, mb, bits = smallest
    where = "the memory cap allows" if capped else f"{hw.name} has"
    return InfeasibleError(
        f"per-device memory binds: the smallest plan (sp_degree={sp}, zero_stage={zero}, "
        f"micro_batch={mb}, {bits}-bit optimizer, lightest checkpointing) needs "
        f"{need / 2**30:.3g} GiB but {where} {limit / 2**30:.3g} GiB usable; "
        f"use more devices, a sequence shorter than {seq_len}, or a device with more memory")
