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
from costmodels.step import PRECISIONS, Choice, StepModel
from hardware_profiles import HardwareProfile
from hardware_profiles.errors import InfeasibleError
from planner.budget import Budget

BYTES_PER_UNIT = 2**16          # memory in 64 KiB units
MICROS_PER_UNIT = 1e-6          # time in microseconds
LOSS_PER_UNIT = 1e-5            # objective resolution, nats
TOKEN_LEVELS = 48


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
                  policies=("none", "save_matmuls", "save_attention", "full"),
                  data_fractions=(0.25, 0.5, 0.75, 1.0)) -> SearchSpace:
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
    combos, smallest = [], None
    for sp, zero, mb, bits in itertools.product(space.sp_degrees, space.zero_stages,
                                                space.micro_batches, space.optimizer_bits):
        base = Choice(sp_degree=sp, zero_stage=zero, micro_batch=mb, seq_len=seq_len,
                      policies=("none",) * L, precision=space.precision, optimizer_bits=bits,
                      devices=devices)
        per = {}
        for e in space.policies:
            c = Choice(**{**_fields(base), "policies": (e,) * L})
            cost = step_model.evaluate(c)
            blk = step_model.block_memory(c, 0, e)
            per[e] = (cost, blk)
        wb, gb, mb_bytes, _ = PRECISIONS[space.precision]
        states = model_state_bytes(step_model.param_numels, weight_bytes=wb, grad_bytes=gb,
                                   master_bytes=mb_bytes, optimizer_bits=bits, zero_stage=zero,
                                   shard_degree=devices, foreach=hw.device_type != "cpu")
        head = step_model._mem("head", mb, seq_len // sp, "none")
        tail = step_model._mem("tail", mb, seq_len // sp, "none")
        lightest = min(per[e][0].memory.total for e in space.policies)
        if smallest is None or lightest < smallest[0]:
            smallest = (lightest, sp, zero, mb, bits)
        opt_peak = (states.params + states.grads + states.optimizer + states.optimizer_step_temp
                    + states.comm_buffers)
        head_bwd = (states.params + states.optimizer + states.comm_buffers + tail.grad_bytes
                    + L * per[space.policies[0]][1].grad_bytes + head.bwd_peak.total)
        if max(opt_peak, head_bwd) > limit:
            continue
        none_cost = per[space.policies[0]][0]
        fixed_time = none_cost.time_s - L * _block_time(step_model, base, 0, space.policies[0])
        combos.append(dict(
            sp=sp, zero=zero, mb=mb, bits=bits,
            base=states.params + states.optimizer + states.comm_buffers + head.retained,
            tail=max(tail.fwd_peak.total, tail.bwd_peak.total), tail_grads=tail.grad_bytes,
            unsharded=step_model.unsharded_bytes(base),
            R={e: per[e][1].retained for e in space.policies},
            F={e: per[e][1].fwd_peak.total for e in space.policies},
            T={e: per[e][1].bwd_peak.total for e in space.policies},
            G=per[space.policies[0]][1].grad_bytes,
            block_s={e: _block_time(step_model, base, 0, e) for e in space.policies},
            fixed_s=fixed_time, tokens_per_step=mb * seq_len * (devices // sp),
            flops={e: per[e][0].flops for e in space.policies}))
    if not combos:
        raise _memory_infeasible(smallest, limit, hw, seq_len, capped=memory_limit_bytes is not None)
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
    n = {e: m.new_int_var(0, L, f"blocks_{e}") for e in space.policies}  # blocks per checkpoint entry
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
    u = {e: m.new_bool_var(f"uses_{e}") for e in space.policies}  # some block takes entry e
    for e in space.policies:
        m.add(n[e] >= u[e])
        m.add(n[e] <= L * u[e])
    mem_cap = int(limit // BYTES_PER_UNIT)
    for zc, c in zip(z, combos):
        # [Constraint] per-device memory <= HBM - reserve, at every phase of the step. Blocks are
        # ordered by retained bytes (smallest first: early blocks hold theirs longest), so the
        # bytes before and after the last / first block of entry e are linear in the counts.
        order = sorted(space.policies, key=lambda e: c["R"][e])
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
    # less recompute (policies are listed from least to most recomputing)
    fr_rank = {f: i for i, f in enumerate(sorted(space.data_fractions, reverse=True))}
    remat_rank = [n[e] * i for i, e in enumerate(_by_recompute(space.policies))]
    w_remat = (len(space.policies) - 1) * L + 1
    tie_terms = [y[k] * k * len(fr_rank) for k in range(len(levels))] + [v * fr_rank[f] for f, v in x.items()]
    w_ties = (len(levels) + 1) * len(fr_rank) * w_remat
    m.minimize(w_ties * (sum(loss_terms) + sum(pen_terms)) + w_remat * sum(tie_terms) + sum(remat_rank))
    # hint: the plain plan (no checkpointing, largest fitting batch) is a natural start
    m.add_hint(n[space.policies[0]], L)

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
    c = combos[next(i for i, v in enumerate(z) if solver.value(v))]
    k = next(i for i, v in enumerate(y) if solver.value(v))
    f = next(fr for fr, v in x.items() if solver.value(v))
    counts = {e: solver.value(n[e]) for e in n}
    # most-saving entries on the earliest blocks: their activations live the longest
    order = sorted(space.policies, key=lambda e: c["R"][e])
    policies = tuple(e for e in order for _ in range(counts[e]))
    choice = Choice(sp_degree=c["sp"], zero_stage=c["zero"], micro_batch=c["mb"], seq_len=seq_len,
                    policies=policies, precision=space.precision, optimizer_bits=c["bits"],
                    devices=devices)
    steps = math.ceil(levels[k] / c["tokens_per_step"])
    return Solution(choice=choice, data_fraction=f, total_tokens=steps * c["tokens_per_step"],
                    max_steps=steps, tokens_per_step=c["tokens_per_step"],
                    predicted_loss=law.predict(n_params, steps * c["tokens_per_step"],
                                               unique_tokens=max(1.0, f * data_tokens)) + bits_pen[c["bits"]],
                    status=solver.status_name(status), objective=solver.objective_value,
                    bound=solver.best_objective_bound, wall_s=time.perf_counter() - t0,
                    n_variables=len(m.proto.variables), n_constraints=len(m.proto.constraints))


def _by_recompute(policies) -> list[str]:
    order = ("none", "save_matmuls", "save_attention", "full")
    return sorted(policies, key=lambda e: order.index(e) if e in order else len(order))


def _fields(c: Choice) -> dict:
    return {f: getattr(c, f) for f in c.__slots__}


def _units(value: float, per_unit: float) -> int:
    return int(math.ceil(value / per_unit))


def _block_time(sm: StepModel, c: Choice, i: int, policy: str) -> float:
    b, s = c.micro_batch, c.seq_len // c.sp_degree
    cost = sm._cost(sm.blocks[i], b, s, c.sp_degree, policy, PRECISIONS[c.precision][3])
    return cost.fwd_s + cost.bwd_s + cost.recompute_s + cost.n_ops * sm.hw.op_overhead_s


def _memory_infeasible(smallest, limit: float, hw: HardwareProfile, seq_len: int,
                       capped: bool) -> InfeasibleError:
    need, sp, zero, mb, bits = smallest
    where = "the memory cap allows" if capped else f"{hw.name} has"
    return InfeasibleError(
        f"per-device memory binds: the smallest plan (sp_degree={sp}, zero_stage={zero}, "
        f"micro_batch={mb}, {bits}-bit optimizer, lightest checkpointing) needs "
        f"{need / 2**30:.3g} GiB but {where} {limit / 2**30:.3g} GiB usable; "
        f"use more devices, a sequence shorter than {seq_len}, or a device with more memory")
