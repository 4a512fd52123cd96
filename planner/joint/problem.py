"""A planning problem: a model captured once on a hardware profile with its search-space options
and loss law (`Problem`, `prepare`), solved by the joint CP-SAT model for a budget
(`solve_problem`) into a `Plan` (`make_plan`), or at the longest sequence the budget trains
(`longest_plan`). `trainplan.planner.api.solve` prepares and solves one;
`trainplan.planner.joint.frontier` and `trainplan.planner.joint.explain` re-solve one under other budgets, memory
caps, device counts and sequence lengths.
"""

from __future__ import annotations

import datetime as _dt
import math
import time
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from trainplan.costmodels.checkpoint_sets import node_keys, resolve
from trainplan.costmodels.loss.cache import law_fields
from trainplan.costmodels.loss.law import BOUND, LossLaw
from trainplan.costmodels.loss.planned import warmup_steps_for
from trainplan.costmodels.step.model import Choice, StepCost, StepModel
from trainplan.costmodels.step.offload import host_limit_bytes
from trainplan.costmodels.step.precision import check_optimizer_bits
from trainplan.errors import BudgetError, InfeasibleError, TrainplanError
from trainplan.hardware_profiles import HardwareProfile
from trainplan.hardware_profiles import load as load_profile
from trainplan.planner.budget import (
    UNLIMITED_DATA_TOKENS,
    Budget,
    check_data_tokens,
    check_devices_usable,
    check_global_batch_tokens,
    check_seed,
    check_time_limit,
)
from trainplan.planner.capture.graph import ModelGraph
from trainplan.planner.capture.layout import sp_refusal
from trainplan.planner.capture.setup import (
    PRECISION_DTYPE,
    check_activation_bits_options,
    default_precision,
    loss_law_for,
    setup_model,
)
from trainplan.planner.joint.remat_menu import BlockMenus, MenuSource
from trainplan.planner.joint.solver import solve_joint
from trainplan.planner.joint.space import (
    SearchSpace,
    check_chunk_options,
    check_offload_options,
    default_space,
    default_tiling,
)
from trainplan.planner.options import DEFAULT_ACTIVATION_BITS, DEFAULT_POLICIES
from trainplan.planner.plan import Decisions, Plan, Predictions, SolverFacts, layout_fields, relative_gap

MEMORY_TOLERANCE = 1e-9
"""Relative float slack of the check that a solved plan's predicted peak is within the limit."""


def check_seq_len(seq_len: object) -> None:
    """Raises: TrainplanError: `seq_len` is not a whole number of tokens >= 1."""
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise TrainplanError(f"seq_len={seq_len!r} must be a positive whole number of tokens")


@dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    """A model captured on a hardware profile with its search-space options and loss law: what
    `solve` builds once and `trainplan.planner.joint.frontier` / `trainplan.planner.joint.explain` re-solve under
    other budgets,
    memory caps, device counts and sequence lengths (`solve_problem`)."""

    profile: HardwareProfile
    precision: str
    graph: ModelGraph
    name: str
    step_model: StepModel
    law: LossLaw
    unique: int
    """Unique training tokens in the corpus."""
    seq_len: int
    options: dict[str, Any]
    """`default_space` options: micro_batches, optimizer_bits, policies, data_fractions,
    activation_bits, global_batch_tokens, loss_chunks, mlp_chunks, offload,
    long_context_when_needed."""
    menus: BlockMenus
    """The step model's solved block menus, kept across re-solves (a problem with another step
    model needs its own)."""

    def space(self, devices: int, seq_len: int | None = None, **options: Any) -> SearchSpace:
        """The search space (`trainplan.planner.joint.space.default_space`) for `devices` devices at `seq_len`
        (default: the problem's), `options` overriding the problem's.

        A model whose attention Ulysses cannot run (`trainplan.planner.capture.layout.sp_refusal`: a
        sliding window, softcapping, its own attention code) is offered SP degree 1 only.

        Raises:
            TrainplanError: no SP degree fits (never for degree 1, kept for other spaces)."""
        seq_len = self.seq_len if seq_len is None else seq_len
        space = default_space(devices=devices, seq_len=seq_len, n_heads=self.graph.n_heads,
                              n_kv_heads=self.graph.n_kv_heads, precision=self.precision,
                              devices_per_node=self.profile.devices_per_node,
                              **(self.options | options))
        if sp_refusal(self.graph.features):
            space = replace(space, sp_degrees=tuple(p for p in space.sp_degrees if p == 1))
        if not space.sp_degrees:
            raise TrainplanError(
                f"no sequence-parallel degree divides devices={devices}, seq_len={seq_len} and "
                f"{self.graph.n_heads} attention heads; use a device count or sequence length they share")
        return space


def prepare(model: nn.Module | str, hw: str | HardwareProfile, *, seq_len: int = 2048,
            data_tokens: int | None = None, vocab_size: int | None = None, precision: str | None = None,
            law: LossLaw | None = None, micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16),
            optimizer_bits: tuple[int, ...] | None = None, policies: tuple[str, ...] = DEFAULT_POLICIES,
            data_fractions: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0),
            activation_bits: object = DEFAULT_ACTIVATION_BITS,
            global_batch_tokens: int | None = None, loss_chunks: tuple[int, ...] | None = None,
            mlp_chunks: tuple[int, ...] | None = None, offload: tuple[bool, ...] | None = None,
            bytes_per_token: float | None = None) -> Problem:
    """Capture `model` on `hw` once (arguments as `trainplan.planner.api.solve`'s) for `solve_problem`.

    Raises:
        UnknownNameError: unknown hardware or preset.
        TrainplanError: bad sequence length, precision or option.
        BudgetError: a global batch that is not a whole number of tokens in range (whether it
            divides into micro-steps is checked per device count, by the solve).
        DataError: data_tokens not a whole number >= seq_len + 1.
        CaptureError: the model cannot be traced.
    """
    check_seq_len(seq_len)
    check_data_tokens(data_tokens, seq_len)
    global_batch_tokens = check_global_batch_tokens(global_batch_tokens)
    check_activation_bits_options(activation_bits)
    if optimizer_bits is not None:  # before the capture: bad widths fail fast
        check_optimizer_bits(optimizer_bits, precision or default_precision(load_profile(hw)))
    profile, precision, graph, name, step_model = setup_model(model, hw, precision=precision,
                                                              vocab_size=vocab_size,
                                                              activation_bits=activation_bits, seq_len=seq_len)
    law = loss_law_for(law, profile, name, graph, bytes_per_token)
    unique = data_tokens if data_tokens is not None else UNLIMITED_DATA_TOKENS
    options = dict(micro_batches=tuple(micro_batches),
                   optimizer_bits=None if optimizer_bits is None else tuple(optimizer_bits),
                   policies=tuple(policies), data_fractions=tuple(data_fractions),
                   activation_bits=check_activation_bits_options(activation_bits),
                   global_batch_tokens=global_batch_tokens)
    tiling = default_tiling(vocab_size=graph.vocab_size, hidden_size=graph.hidden_size,
                            intermediate_size=graph.intermediate_size,
                            act_bytes=2 if precision != "fp32" else 4, unified_memory=profile.unified_memory)
    given = dict(loss_chunks=loss_chunks, mlp_chunks=mlp_chunks, offload=offload)
    for key, value in given.items():
        options[key] = (tiling[key] if value is None else check_offload_options(value) if key == "offload"
                        else check_chunk_options(value, key))
    # values given: searched wherever they may pay; the defaults: only where nothing fits without
    options["long_context_when_needed"] = loss_chunks is None and mlp_chunks is None and offload is None
    pr = Problem(profile=profile, precision=precision, graph=graph, name=name, step_model=step_model,
                 law=law, unique=int(unique), seq_len=seq_len, options=options, menus=BlockMenus(step_model))
    pr.space(1)  # bad options fail here, before any solve
    return pr


def solve_problem(pr: Problem, budget: Budget, *, seq_len: int | None = None,
                  memory_limit_bytes: float | None = None, time_limit_s: float = 10.0, seed: int = 0,
                  lr: float = 3e-3, export_path: str | None = None, menus: MenuSource | None = None,
                  diagnose: bool = True, **options: Any) -> Plan:
    """Solve a prepared problem for `budget` (at `seq_len`, default the problem's; `options`
    override the search space's, e.g. `policies`). `menus`: a stand-in for the problem's block
    menus (`trainplan.planner.joint.frontier` shares one per block shape across caps). `diagnose`: as
    `solve_joint`'s. The joint model's memory is `StepModel.evaluate`'s, phase by phase
    (`trainplan.planner.joint.combos`), so the plan fits by its own prediction; a plan that does not is a
    bug, not an input error.

    Raises:
        TrainplanError: bad sequence length or budget.
        BudgetError: a time limit or seed out of range; more devices than the corpus can feed; a
            global batch no SP degree and micro-batch divides at this device count and sequence.
        InfeasibleError: nothing fits (the solver's message, not explained: see `trainplan.planner.api.solve`).
        RuntimeError: internal: the solved plan's predicted peak is over the limit.
    """
    seq_len = pr.seq_len if seq_len is None else seq_len
    check_seq_len(seq_len)
    if not isinstance(budget, Budget):
        raise TrainplanError(f"budget must be a trainplan.planner.Budget, got {type(budget).__name__}")
    time_limit_s, seed = check_time_limit(time_limit_s), check_seed(seed)
    space = pr.space(budget.devices, seq_len, **options)
    check_devices_usable(budget.devices, seq_len, space.sp_degrees, pr.unique)
    sm = pr.step_model
    t0 = time.perf_counter()
    sol = solve_joint(sm, pr.profile, budget, seq_len=seq_len, space=space,
                      n_params=pr.graph.law_n_params, data_tokens=pr.unique, law=pr.law,
                      memory_limit_bytes=memory_limit_bytes, time_limit_s=time_limit_s, seed=seed,
                      export_path=export_path, diagnose=diagnose,
                      menus=pr.menus if menus is None else menus)
    # a defensive check, not a repair: the solver's bytes are evaluate's (see the docstring)
    limit = min(pr.profile.usable_bytes, math.inf if memory_limit_bytes is None else memory_limit_bytes)
    peak = sm.evaluate(sol.choice).memory
    if peak.total > limit * (1 + MEMORY_TOLERANCE):
        raise RuntimeError(
            f"internal error: the solved plan predicts {peak.total / 2**30:.4g} GiB at {peak.phase} "
            f"but the limit is {limit / 2**30:.4g} GiB (the joint model counted "
            f"{sol.peak_bytes / 2**30:.4g} GiB); please report it with the inputs")
    facts = SolverFacts(status=sol.status, objective=sol.objective, bound=sol.bound,
                        wall_s=time.perf_counter() - t0, seed=seed, time_limit_s=time_limit_s,
                        n_variables=sol.n_variables, n_constraints=sol.n_constraints,
                        gap=relative_gap(sol.status, sol.objective, sol.bound))
    return make_plan(sm, pr.profile, pr.graph, pr.name, sol.choice, budget=budget.to_dict(),
                     data_fraction=sol.data_fraction, max_steps=sol.max_steps,
                     predicted_loss=sol.predicted_loss, unique=pr.unique, law=pr.law, lr=lr, seed=seed,
                     facts=facts, memory_limit_bytes=memory_limit_bytes)


def checkpoint_block_ops(step_model: StepModel, blocks: tuple[str, ...], c: Choice,
                         device_type: str) -> dict[str, dict[str, Any]]:
    """`Decisions.checkpoint_block_ops` of choice `c`: for each captured region a checkpointed
    layer runs (`StepModel.region_for`, e.g. `block0`, `block0@mp` under FSDP2's mixed precision),
    its layers and the ops of its forward in execution order (`node_keys` without the call
    counts), captured with `device_type`'s kernels. Layers that are not checkpointed are left out."""
    sets = {x.name: x for x in c.sets}
    out: dict[str, dict[str, Any]] = {}
    for i, (policy, block) in enumerate(zip(c.policies, blocks, strict=True)):
        entry = resolve(policy, sets)
        if not entry.checkpointed:
            continue
        region = step_model.region_for(c, block, entry)
        if region not in out:
            ops = [key.rpartition("#")[0] for key in node_keys(step_model.regions[region]).values()]
            out[region] = {"layers": [], "ops": ops, "device_type": device_type}
        out[region]["layers"].append(i)
    return out


def loss_facts(law: LossLaw, n_params: float, tokens: float, unique_tokens: float, *, batch_tokens: float,
               warmup_steps: int) -> dict[str, Any]:
    """The plan's record of its loss prediction (`Predictions.loss_regime`, `loss_band_nats`,
    `loss_law`): the regime and band of `law` at this run (`LossLaw.regime` of the law's own,
    unbounded value: `BOUND` near ln V; `LossLaw.band`) and the law's constants."""
    kw = dict(batch_tokens=batch_tokens, warmup_tokens=min(warmup_steps * batch_tokens, tokens))
    raw = law.predict(n_params, tokens, unique_tokens, bounded=False, **kw)
    return dict(loss_regime=law.regime(n_params, tokens, raw_loss=raw),
                loss_band_nats=law.band(n_params, tokens, unique_tokens, **kw), loss_law=law_fields(law))


def bound_warning(law: LossLaw, regime: str, loss: float) -> tuple[str, ...]:
    """The plan's warning when its predicted loss is a bound (`BOUND`), not a prediction."""
    if regime != BOUND:
        return ()
    return (f"predicted loss {loss:.3f} nats is a bound near ln(V) = {law.ceiling:.3f}, not a prediction: the "
            f"law ({law.source}) is above 0.9 ln(V) here, far outside what it was fitted on (a budget too small "
            "for its range, or no corpus for pilots); rank plans by it only as 'more tokens is lower'; for a "
            "prediction give a corpus (`--data`, `data=`) to fit pilots on, with a budget they fit in (10%), or "
            "`trainplan calibrate` a run",)


def make_plan(step_model: StepModel, profile: HardwareProfile, graph: ModelGraph, name: str, c: Choice, *,
              budget: dict[str, Any], data_fraction: float, max_steps: int, predicted_loss: float, unique: int,
              law: LossLaw, lr: float, seed: int, facts: SolverFacts, memory_limit_bytes: float | None) -> Plan:
    """The Plan of choice `c` for model `name` (its `graph`) on `profile`: decisions as given
    (random data subset, no governor, warm-up over a tenth of the steps, at most 20), predictions
    of `step_model.evaluate(c)` over `max_steps` steps (`predicted_loss`, nats/token, from the
    caller), `budget` as the Plan records it, `facts` how it was solved.

    Raises:
        TrainplanError: a prediction is not finite (a broken capture)."""
    cost = step_model.evaluate(c)  # one optimizer step: `c.grad_accum` micro-steps
    tokens_per_step = c.micro_batch * c.seq_len * (c.devices // c.sp_degree) * c.grad_accum
    peak_flops = profile.peak(PRECISION_DTYPE[c.precision])
    decisions = Decisions(
        devices=c.devices, sp_degree=c.sp_degree, dp_degree=c.devices // c.sp_degree,
        zero_stage=c.zero_stage, micro_batch=c.micro_batch, grad_accum=c.grad_accum, seq_len=c.seq_len,
        activation_checkpoint=c.policies,
        checkpoint_sets={x.name: sorted(x.saved or ()) for x in c.sets if x.name in c.policies},
        checkpoint_block_ops=checkpoint_block_ops(step_model, graph.blocks, c, profile.device_type),
        precision=c.precision, optimizer_bits=c.optimizer_bits, activation_bits=c.activation_bits,
        loss_chunks=c.loss_chunks, mlp_chunks=c.mlp_chunks, offload=c.offload, data_fraction=data_fraction,
        data_method="random", max_tokens=max_steps * tokens_per_step, max_steps=max_steps,
        governor_threshold=0.0, lr=lr, warmup_steps=warmup_steps_for(max_steps), seed=seed)
    limit = float(profile.usable_bytes if memory_limit_bytes is None
                  else min(memory_limit_bytes, profile.usable_bytes))
    predictions = Predictions(
        memory_bytes=cost.memory.as_dict(), memory_phase=cost.memory.phase, memory_limit_bytes=limit,
        step_time_s=cost.time_s,
        step_time_breakdown_s=cost.breakdown(),
        flops_per_step=cost.flops, model_flops_per_step=cost.model_flops,
        tokens_per_step=tokens_per_step, total_tokens=max_steps * tokens_per_step,
        device_hours=cost.time_s * max_steps * c.devices / 3600.0, final_loss=predicted_loss,
        mfu=cost.model_flops / (cost.time_s * peak_flops) if cost.time_s > 0 else 0.0,
        made_for=layout_fields(decisions), host_memory_bytes=cost.host_bytes,
        host_memory_limit_bytes=0.0 if profile.unified_memory else host_limit_bytes(profile),
        **loss_facts(law, graph.law_n_params, max_steps * tokens_per_step, max(1.0, data_fraction * unique),
                     batch_tokens=tokens_per_step, warmup_steps=decisions.warmup_steps))
    if not all(math.isfinite(v) for v in (cost.flops, cost.time_s, cost.memory.total)):
        raise TrainplanError("predictions are not finite; the captured graph is broken")
    overlap = (f"communication overlapped with compute as the executor issues it: "
               f"{cost.comm_s:.3g} s of {cost.comm_total_s:.3g} s exposed (trainplan.costmodels.step.overlap)"
               if step_model.overlap else "communication added to compute, not overlapped: a conservative bound")
    notes = (overlap, f"loss law: {law.source}", *long_context_notes(c, cost, profile))
    warnings = bound_warning(law, predictions.loss_regime, predicted_loss)
    return Plan(model=name, model_n_params=graph.n_params, model_n_layers=graph.n_layers,
                model_n_active_params=graph.n_active_params or None,
                hw=profile.name, budget=dict(budget) | {"seq_len": c.seq_len}, data_tokens=int(unique),
                vocab_size=graph.vocab_size, decisions=decisions, predictions=predictions, solver=facts,
                created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), notes=notes, warnings=warnings)


def long_context_notes(c: Choice, cost: StepCost, profile: HardwareProfile) -> tuple[str, ...]:
    """The plan's notes on its long-context knobs (`Choice.loss_chunks`, `mlp_chunks`,
    `offload`): what each does and, for offload, the host memory it fills."""
    notes = []
    if c.loss_chunks > 1:
        notes.append(f"tiled loss: the LM head and cross-entropy run over {c.loss_chunks} sequence chunks, "
                     "each recomputed in the backward (trainplan.modeling.tiling)")
    if c.mlp_chunks > 1:
        notes.append(f"tiled MLP: every block's MLP runs over {c.mlp_chunks} sequence chunks, each "
                     "recomputed in the backward (trainplan.modeling.tiling)")
    if c.offload:
        notes.append("activation offload: nothing moves on this unified-memory device (host memory is "
                     "device memory)" if profile.unified_memory else
                     f"activation offload: checkpointed blocks' inputs in host memory, "
                     f"{cost.host_bytes / 2**30:.3g} GiB per device of {host_limit_bytes(profile) / 2**30:.3g} "
                     f"GiB (the node's host memory over its {profile.devices_per_node} devices); "
                     f"{cost.offload_s:.3g} s per step of copies exposed (trainplan.modeling.offload)")
    return tuple(notes)


# ---- the longest sequence a budget trains (`trainplan solve --max-seq-len`) ------------------
# Per-device memory grows with the sequence at every knob setting (every captured size is a
# polynomial in the sequence with non-negative coefficients), and a longer sequence buys fewer
# steps of a budget, so "a plan exists at this length" is monotone: doubling, then bisection,
# about 2 log2(longest / granularity) solves of one prepared problem (one capture; tiled regions
# are traced once, at their first use).

GRANULARITY_TOKENS = 1024
"""Sequence lengths tried: multiples of this (a multiple of every SP degree up to 1024)."""
MAX_TOKENS = 2**26
"""The search's ceiling, 64M tokens: a plan that fits there is reported at the ceiling."""


def longest_plan(pr: Problem, budget: Budget, *, granularity: int = GRANULARITY_TOKENS,
                 up_to: int = MAX_TOKENS, **solve_options: Any) -> Plan:
    """The plan (`solve_problem`, with `solve_options`) at the longest multiple of `granularity`
    tokens, at most `up_to`, for which the budget has a plan; its notes say how it was found.

    Raises:
        TrainplanError: `granularity` or `up_to` not a whole number >= 1, or `up_to` below
            `granularity`.
        InfeasibleError: not even `granularity` tokens fit (the solver's message at that length)."""
    for what, v in (("granularity", granularity), ("up_to", up_to)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise TrainplanError(f"{what}={v!r} must be a whole number of tokens >= 1")
    if up_to < granularity:
        raise TrainplanError(f"up_to={up_to} is below granularity={granularity}: nothing to search")
    plans: dict[int, Plan | None] = {}

    def fits(k: int) -> bool:
        if k not in plans:
            try:
                plans[k] = solve_problem(pr, budget, seq_len=k * granularity, diagnose=False, **solve_options)
            except (InfeasibleError, BudgetError):
                plans[k] = None
        return plans[k] is not None

    top = up_to // granularity
    if not fits(1):
        return solve_problem(pr, budget, seq_len=granularity, **solve_options)  # raises with the reason
    lo, hi = 1, 2
    while hi <= top and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, top + 1)
    while hi - lo > 1:  # fits(lo), and hi does not fit or is past the ceiling
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    plan = plans[lo]
    assert plan is not None
    beyond = "the search ceiling" if lo == top else f"{(lo + 1) * granularity} has none"
    how = (f"longest sequence: {lo * granularity} tokens, the longest multiple of {granularity} with a plan "
           f"for this budget ({len(plans)} solves; {beyond})")
    return replace(plan, notes=(*plan.notes, how))
