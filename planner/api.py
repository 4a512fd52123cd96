"""`solve()`: model x hardware x budget -> Plan."""

from __future__ import annotations

import datetime as _dt
import math
import time
from dataclasses import dataclass

from torch import nn

from costmodels.loss.law import LossLaw
from costmodels.step.model import StepModel
from hardware_profiles import HardwareProfile
from hardware_profiles import load as load_profile
from planner.budget import Budget, check_data_tokens, check_devices_usable, check_seed, check_time_limit
from planner.capture.graph import ModelGraph
from planner.capture.setup import (  # noqa: F401 (re-exported)
    PRECISION_DTYPE,
    _check_bits_options,
    _law_for,
    _setup,
    capture_model,
    default_precision,
)
from planner.joint.solver import default_space, solve_joint
from planner.plan import Decisions, Plan, Predictions, SolverFacts, layout_fields, relative_gap
from trainplan_errors import InfeasibleError, TrainplanError

DEFAULT_ACTIVATION_BITS = (32,)
"""Saved-activation widths `solve` chooses from by default: as computed. Each width is one more
capture of every region and multiplies the joint model's shape combos (llama3-8b at 8192 tokens
on 8 x h100: 4 s and OPTIMAL with (32,), a 10 s limit hit, FEASIBLE, with (32, 16, 8), on a
loaded 2-core machine); pass `activation_bits=(32, 16, 8)` (CLI `--activation-bits 32,16,8`)
where memory binds."""
MEMORY_TOLERANCE = 1e-9
"""Relative float slack of the check that a solved plan's predicted peak is within the limit."""
UNLIMITED_DATA_TOKENS = 15 * 10**12
"""Default unique tokens when no corpus size is given: Llama 3's 15T pre-training tokens
(Meta, "The Llama 3 Herd of Models", 2024), i.e. no repetition for any plan here."""


def _check_seq_len(seq_len) -> None:
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise TrainplanError(f"seq_len={seq_len!r} must be a positive whole number of tokens")


@dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    """A model captured on a hardware profile with its search-space options and loss law: what
    `solve` builds once and `planner.joint.frontier` / `planner.joint.explain` re-solve under other budgets,
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
    options: dict
    """`default_space` options: micro_batches, optimizer_bits, policies, data_fractions."""

    def space(self, devices: int, seq_len: int | None = None, **options):
        """The search space (`planner.joint.solver.default_space`) for `devices` devices at `seq_len`
        (default: the problem's), `options` overriding the problem's.

        Raises:
            TrainplanError: no SP degree fits (never for degree 1, kept for other spaces)."""
        seq_len = self.seq_len if seq_len is None else seq_len
        space = default_space(devices=devices, seq_len=seq_len, n_heads=self.graph.n_heads,
                              n_kv_heads=self.graph.n_kv_heads, precision=self.precision,
                              devices_per_node=self.profile.devices_per_node,
                              **(self.options | options))
        if not space.sp_degrees:
            raise TrainplanError(
                f"no sequence-parallel degree divides devices={devices}, seq_len={seq_len} and "
                f"{self.graph.n_heads} attention heads; use a device count or sequence length they share")
        return space


def prepare(model: nn.Module | str, hw: str | HardwareProfile, *, seq_len: int = 2048,
            data_tokens: int | None = None, vocab_size: int | None = None, precision: str | None = None,
            law: LossLaw | None = None, micro_batches=(1, 2, 4, 8, 16), optimizer_bits=None,
            policies=("none", "save_matmuls", "save_attention", "full", "remat"),
            data_fractions=(0.25, 0.5, 0.75, 1.0), activation_bits=DEFAULT_ACTIVATION_BITS) -> Problem:
    """Capture `model` on `hw` once (arguments as `solve`'s) for `solve_problem`.

    Raises:
        UnknownNameError: unknown hardware or preset.
        TrainplanError: bad sequence length, precision or option.
        DataError: data_tokens not a whole number >= seq_len + 1.
        CaptureError: the model cannot be traced.
    """
    _check_seq_len(seq_len)
    check_data_tokens(data_tokens, seq_len)
    _check_bits_options(activation_bits)
    if optimizer_bits is not None:  # before the capture: bad widths fail fast
        from costmodels.step.precision import check_optimizer_bits

        check_optimizer_bits(optimizer_bits, precision or default_precision(load_profile(hw)))
    profile, precision, graph, name, step_model = _setup(model, hw, precision=precision,
                                                         vocab_size=vocab_size,
                                                         activation_bits=activation_bits)
    law = _law_for(law, profile, name, graph)
    unique = data_tokens if data_tokens is not None else UNLIMITED_DATA_TOKENS
    options = dict(micro_batches=tuple(micro_batches),
                   optimizer_bits=None if optimizer_bits is None else tuple(optimizer_bits),
                   policies=tuple(policies), data_fractions=tuple(data_fractions),
                   activation_bits=_check_bits_options(activation_bits))
    pr = Problem(profile=profile, precision=precision, graph=graph, name=name, step_model=step_model,
                 law=law, unique=int(unique), seq_len=seq_len, options=options)
    pr.space(1)  # bad options fail here, before any solve
    return pr


def solve_problem(pr: Problem, budget: Budget, *, seq_len: int | None = None,
                  memory_limit_bytes: float | None = None, time_limit_s: float = 10.0, seed: int = 0,
                  lr: float = 3e-3, export_path: str | None = None, step_model=None,
                  diagnose: bool = True, **options) -> Plan:
    """Solve a prepared problem for `budget` (at `seq_len`, default the problem's; `options`
    override the search space's, e.g. `policies`). `step_model`: a stand-in for the problem's
    (`planner.joint.frontier` shares menus across caps through one). `diagnose`: as `solve_joint`'s.
    The joint model's memory is `StepModel.evaluate`'s, phase by phase (`planner.joint.combos`), so
    the plan fits by its own prediction; a plan that does not is a bug, not an input error.

    Raises:
        TrainplanError: bad sequence length or budget.
        BudgetError: a time limit or seed out of range; more devices than the corpus can feed.
        InfeasibleError: nothing fits (the solver's message, not explained: see `solve`).
        RuntimeError: internal: the solved plan's predicted peak is over the limit.
    """
    seq_len = pr.seq_len if seq_len is None else seq_len
    _check_seq_len(seq_len)
    if not isinstance(budget, Budget):
        raise TrainplanError(f"budget must be a planner.Budget, got {type(budget).__name__}")
    time_limit_s, seed = check_time_limit(time_limit_s), check_seed(seed)
    space = pr.space(budget.devices, seq_len, **options)
    check_devices_usable(budget.devices, seq_len, space.sp_degrees, pr.unique)
    sm = step_model or pr.step_model
    t0 = time.perf_counter()
    sol = solve_joint(sm, pr.profile, budget, seq_len=seq_len, space=space,
                      n_params=pr.graph.n_params, data_tokens=pr.unique, law=pr.law,
                      memory_limit_bytes=memory_limit_bytes, time_limit_s=time_limit_s, seed=seed,
                      export_path=export_path, diagnose=diagnose)
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
    return _make_plan(sm, pr.profile, pr.graph, pr.name, sol.choice, budget=budget.to_dict(),
                      data_fraction=sol.data_fraction, max_steps=sol.max_steps,
                      predicted_loss=sol.predicted_loss, unique=pr.unique, law=pr.law, lr=lr, seed=seed,
                      facts=facts, memory_limit_bytes=memory_limit_bytes)


def solve(model: nn.Module | str, hw: str | HardwareProfile, budget: Budget, *, seq_len: int = 2048,
          data_tokens: int | None = None, vocab_size: int | None = None, precision: str | None = None,
          law: LossLaw | None = None, micro_batches=(1, 2, 4, 8, 16), optimizer_bits=None,
          activation_bits=DEFAULT_ACTIVATION_BITS,
          policies=("none", "save_matmuls", "save_attention", "full", "remat"),
          data_fractions=(0.25, 0.5, 0.75, 1.0), memory_limit_bytes: float | None = None,
          time_limit_s: float = 10.0, seed: int = 0, lr: float = 3e-3,
          export_path: str | None = None, explain: bool = True,
          data_methods=("random", "dsir", "loss", "influence"), data_quality=None) -> Plan:
    """Plan a training run: every knob chosen jointly by one CP-SAT model.

    Args:
        model: an `nn.Module` (HF-style causal LM) or a preset name (`trainplan profiles`
            lists hardware, `modeling.presets.known_presets()` models).
        hw: hardware profile name or alias (`mi300`, `h100`, `cpu`, ...) or a profile.
        budget: device-hours, wall-clock seconds or FLOPs, and the device count.
        seq_len: tokens per sequence.
        data_tokens: unique training tokens in the corpus (None: unconstrained).
        vocab_size: overrides the preset's vocabulary (a run uses its tokenizer's).
        optimizer_bits: Adam-state widths to choose from (None: the precision's two widest the
            executor runs, `costmodels.step.model.optimizer_bits_for`: 32 and 8, or 16 and 8 for bf16;
            4 on request).
        activation_bits: saved-activation widths to choose from (32 = as computed, 16, 8;
            `modeling.activation_compression`); each one below 32 is captured once more.
        memory_limit_bytes: per-device memory cap below the profile's usable bytes.
        explain: on an infeasible budget, re-solve to name the smallest change that fits
            (`planner.joint.explain`); False raises the solver's own message at once.
        data_methods: data-subset scoring methods to choose from with the fraction
            (`planner.data_choice.choose_data_method`: the data-constrained law times each
            method's quality multiplier, at the tokens its scoring leaves of the budget; a method
            without a known multiplier drops out); ("random",) keeps the solver's random subset.
        data_quality: {method: `costmodels.data.value.QualityFit`} overriding the cached and
            published multipliers.

    Raises:
        UnknownNameError: unknown hardware or preset.
        TrainplanError: bad sequence length, SP degree, option or data method.
        BudgetError: a time limit or seed out of range; more devices than the corpus can feed.
        DataError: data_tokens not a whole number >= seq_len + 1.
        CaptureError: the model cannot be traced (e.g. a graph break).
        InfeasibleError: nothing fits; the message names the binding term with both numbers
            and (with `explain`) the smallest change that fits, confirmed by a re-solve; the
            error's `explanation` and `suggestions` carry the same as data.
    """
    _check_seq_len(seq_len)
    if not isinstance(budget, Budget):
        raise TrainplanError(f"budget must be a planner.Budget, got {type(budget).__name__}")
    check_time_limit(time_limit_s)
    check_seed(seed)
    from planner.data_choice import check_data_methods, choose_data_method

    data_methods = check_data_methods(data_methods)
    pr = prepare(model, hw, seq_len=seq_len, data_tokens=data_tokens, vocab_size=vocab_size,
                 precision=precision, law=law, micro_batches=micro_batches,
                 optimizer_bits=optimizer_bits, policies=policies, data_fractions=data_fractions,
                 activation_bits=activation_bits)
    try:
        plan = solve_problem(pr, budget, memory_limit_bytes=memory_limit_bytes,
                             time_limit_s=time_limit_s, seed=seed, lr=lr, export_path=export_path,
                             diagnose=not explain)
    except InfeasibleError as e:
        if not explain:
            raise
        from planner.joint.explain import explain_infeasible

        raise explain_infeasible(pr, budget, e, memory_limit_bytes=memory_limit_bytes) from e
    return choose_data_method(plan, pr.law, methods=data_methods, fractions=data_fractions,
                              fits=data_quality)


def plan_for_choice(model: nn.Module | str, hw: str | HardwareProfile, *, seq_len: int,
                    micro_batch: int, checkpoint: tuple[str, ...] | str = "none",
                    checkpoint_sets: dict[str, list[str]] | None = None, sp_degree: int = 1,
                    devices: int = 1, zero_stage: int = 0, optimizer_bits: int | None = None,
                    activation_bits: int = 32, precision: str | None = None, data_fraction: float = 1.0, max_steps: int = 10,
                    data_tokens: int | None = None, vocab_size: int | None = None,
                    law: LossLaw | None = None, lr: float = 3e-3, seed: int = 0,
                    data_method: str = "random", selection_every_steps: int = 0) -> Plan:
    """A Plan with every knob fixed by the caller, predictions from the same cost models, no
    solver (status `FIXED`): for baselines, benchmarks and what-if questions. `data_method`
    and `selection_every_steps` (dynamic selection) as `planner.data_choice.with_data_method`
    sets them: nothing is taken off `max_steps` for scoring.

    Raises:
        TrainplanError: a knob out of range (SP degree not dividing devices, heads or sequence;
            unknown policy; ZeRO stage; bits).
    """
    from costmodels.checkpoint_sets import check_policy, sets_from_mapping
    from costmodels.step import comm
    from costmodels.step.model import Choice

    _check_seq_len(seq_len)
    profile, precision, graph, name, step_model = _setup(model, hw, precision=precision,
                                                         vocab_size=vocab_size,
                                                         activation_bits=(activation_bits,))
    from costmodels.step.precision import optimizer_bits_for

    valid_bits = optimizer_bits_for(precision)
    optimizer_bits = valid_bits[0] if optimizer_bits is None else optimizer_bits
    if isinstance(optimizer_bits, bool) or optimizer_bits not in valid_bits:
        raise TrainplanError(f"optimizer_bits={optimizer_bits!r} cannot run with precision={precision!r}: "
                             f"use {', '.join(map(str, valid_bits))}")
    policies = (checkpoint,) * graph.n_layers if isinstance(checkpoint, str) else tuple(checkpoint)
    if len(policies) != graph.n_layers:
        raise TrainplanError(f"checkpoint has {len(policies)} entries; {name} has {graph.n_layers} layers")
    sets = sets_from_mapping(checkpoint_sets)
    for p in policies:
        check_policy(p, sets)
    valid = [p for p in comm.valid_sp_degrees(seq_len, graph.n_heads, graph.n_kv_heads) if devices % p == 0]
    if sp_degree not in valid:
        raise TrainplanError(f"sp_degree={sp_degree} is not valid for devices={devices}, seq_len={seq_len} "
                             f"and {graph.n_heads} heads: valid degrees are {valid}")
    if not isinstance(max_steps, int) or max_steps < 1:
        raise TrainplanError(f"max_steps={max_steps!r} must be a whole number >= 1")
    choice = Choice(sp_degree=sp_degree, zero_stage=zero_stage, micro_batch=micro_batch, seq_len=seq_len,
                    policies=policies, precision=precision, optimizer_bits=optimizer_bits, devices=devices,
                    activation_bits=activation_bits, sets=tuple(x for x in sets.values() if x.name in policies))
    law = _law_for(law, profile, name, graph)
    unique = data_tokens if data_tokens is not None else UNLIMITED_DATA_TOKENS
    tokens = max_steps * micro_batch * seq_len * (devices // sp_degree)
    from costmodels.loss.bits import bits_loss_penalty

    loss = law.predict(graph.n_params, tokens, unique_tokens=max(1.0, data_fraction * unique))
    loss += bits_loss_penalty(optimizer_bits, activation_bits, precision=precision, penalty=law.bits)
    facts = SolverFacts(status="FIXED", objective=0.0, bound=0.0, wall_s=0.0, seed=seed, time_limit_s=0.0)
    plan = _make_plan(step_model, profile, graph, name, choice, budget={"devices": devices, "fixed_steps": max_steps},
                      data_fraction=data_fraction, max_steps=max_steps, predicted_loss=loss,
                      unique=unique, law=law, lr=lr, seed=seed, facts=facts, memory_limit_bytes=None)
    if data_method == "random" and selection_every_steps == 0:
        return plan
    from planner.data_choice import with_data_method

    return with_data_method(plan, data_method, selection_every_steps=selection_every_steps, law=law)


def _make_plan(step_model, profile, graph, name, c, *, budget, data_fraction, max_steps, predicted_loss,
               unique, law, lr, seed, facts, memory_limit_bytes) -> Plan:
    cost = step_model.evaluate(c)
    tokens_per_step = c.micro_batch * c.seq_len * (c.devices // c.sp_degree)
    peak_flops = profile.peak(PRECISION_DTYPE[c.precision])
    decisions = Decisions(
        devices=c.devices, sp_degree=c.sp_degree, dp_degree=c.devices // c.sp_degree,
        zero_stage=c.zero_stage, micro_batch=c.micro_batch, seq_len=c.seq_len, checkpoint=c.policies,
        checkpoint_sets={x.name: sorted(x.saved) for x in c.sets if x.name in c.policies},
        precision=c.precision, optimizer_bits=c.optimizer_bits, activation_bits=c.activation_bits,
        data_fraction=data_fraction,
        data_method="random", max_tokens=max_steps * tokens_per_step, max_steps=max_steps,
        governor_threshold=0.0, lr=lr, warmup_steps=max(1, min(20, max_steps // 10)), seed=seed)
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
        made_for=layout_fields(decisions))
    if not all(math.isfinite(v) for v in (cost.flops, cost.time_s, cost.memory.total)):
        raise TrainplanError("predictions are not finite; the captured graph is broken")
    notes = ("communication is added to compute, not overlapped: a conservative time bound",
             f"loss law: {law.source}")
    return Plan(model=name, model_n_params=graph.n_params, model_n_layers=graph.n_layers,
                hw=profile.name, budget=dict(budget) | {"seq_len": c.seq_len}, data_tokens=int(unique),
                vocab_size=graph.vocab_size, decisions=decisions, predictions=predictions, solver=facts,
                created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), notes=notes)
