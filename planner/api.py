"""`solve()`: model x hardware x budget -> Plan, every knob chosen jointly; and `plan_for_choice`,
a Plan with every knob fixed by the caller. The problem behind a solve (capture, search space,
the joint CP-SAT model) is `trainplan.planner.joint.problem`'s.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import nn

from trainplan.costmodels.checkpoint_sets import check_policy, sets_from_mapping
from trainplan.costmodels.loss.bits import bits_loss_penalty
from trainplan.costmodels.loss.cache import law_from_fields
from trainplan.costmodels.loss.law import LossLaw
from trainplan.costmodels.loss.planned import (
    LAW_MIN_FLOPS,
    SMALL_RUN_LR,
    law_batch_tokens,
    lr_warning,
    planned_lr,
    planned_warmup_steps,
    run_loss,
)
from trainplan.costmodels.step import comm
from trainplan.costmodels.step.model import Choice
from trainplan.costmodels.step.precision import optimizer_bits_for
from trainplan.errors import InfeasibleError, TrainplanError
from trainplan.hardware_profiles import HardwareProfile
from trainplan.modeling.configs import max_positions, position_warning
from trainplan.modeling.tiling import check_chunks
from trainplan.planner.budget import (
    UNLIMITED_DATA_TOKENS,
    Budget,
    check_global_batch_tokens,
    check_seed,
    check_time_limit,
)
from trainplan.planner.capture.layout import sp_refusal
from trainplan.planner.capture.setup import loss_law_for, setup_model
from trainplan.planner.data_choice import check_data_methods, choose_data_method, with_data_method
from trainplan.planner.joint.explain import explain_infeasible
from trainplan.planner.joint.problem import (
    GRANULARITY_TOKENS,
    MAX_TOKENS,
    check_seq_len,
    longest_plan,
    make_plan,
    prepare,
    solve_problem,
)
from trainplan.planner.joint.space import check_chunk_options
from trainplan.planner.options import SolveOptions, options_from
from trainplan.planner.pilots import calibrated, with_calibration
from trainplan.planner.plan import HW_FROM_FILE, Plan, SolverFacts


def solve(model: nn.Module | str, hw: str | HardwareProfile, budget: Budget, options: SolveOptions | None = None,
          **overrides: Any) -> Plan:
    """Plan a training run: every knob chosen jointly by one CP-SAT model.

    Args:
        model: an `nn.Module` (HF-style causal LM) or a preset name (`trainplan profiles`
            lists hardware, `trainplan.modeling.presets.known_presets()` models).
        hw: hardware profile name or alias (`mi300`, `h100`, `cpu`, ...) or a profile.
        budget: device-hours, wall-clock seconds or FLOPs, and the device count.
        options: a `trainplan.planner.options.SolveOptions` (None: its defaults): the sequence length,
            the search space, limits, the loss law and corpus; each field is documented there.
        overrides: keywords naming `SolveOptions` fields (`seq_len=8192`), applied over `options`.
        The plan records the options it was solved with (`Plan.options`).

    Raises:
        UnknownNameError: unknown hardware or preset.
        TrainplanError: an override that names no option; bad sequence length, SP degree, option
            or data method; a pilot that stopped early.
        BudgetError: a time limit or seed out of range; more devices than the corpus can feed; a
            global batch that is not a whole number of tokens in range, or that no SP degree and
            micro-batch divides (the message names the nearest valid global batches).
        DataError: data_tokens not a whole number >= seq_len + 1.
        CaptureError: the model cannot be traced (e.g. a graph break).
        InfeasibleError: nothing fits; the message names the binding term with both numbers
            and (with `explain`) the smallest change that fits, confirmed by a re-solve; the
            error's `explanation` and `suggestions` carry the same as data.
    """
    o = options_from(options, overrides)
    check_seq_len(o.seq_len)
    if not isinstance(budget, Budget):
        raise TrainplanError(f"budget must be a trainplan.planner.Budget, got {type(budget).__name__}")
    check_time_limit(o.time_limit_s)
    check_seed(o.seed)
    check_global_batch_tokens(o.global_batch_tokens)
    data_methods = check_data_methods(o.data_methods)
    pr = prepare(model, hw, seq_len=o.seq_len, data_tokens=o.data_tokens, vocab_size=o.vocab_size,
                 precision=o.precision, law=o.law, micro_batches=o.micro_batches,
                 optimizer_bits=o.optimizer_bits, policies=o.policies, data_fractions=o.data_fractions,
                 activation_bits=o.activation_bits, global_batch_tokens=o.global_batch_tokens,
                 loss_chunks=o.loss_chunks, mlp_chunks=o.mlp_chunks, offload=o.offload,
                 bytes_per_token=o.bytes_per_token)
    lr = SMALL_RUN_LR if o.lr is None else o.lr  # the pilots' (they run on this CPU, far below 1e17 FLOPs)
    pr, budget, calibration = calibrated(pr, model, budget, o.data, enabled=o.calibrate and o.law is None, lr=lr,
                                         seed=o.seed, bytes_per_token=o.bytes_per_token, cache_dir=o.cache_dir)
    try:
        plan = solve_problem(pr, budget, memory_limit_bytes=o.memory_limit_bytes,
                             time_limit_s=o.time_limit_s, seed=o.seed, lr=lr, export_path=o.export_path,
                             diagnose=not o.explain)
    except InfeasibleError as e:
        if not o.explain:
            raise
        raise explain_infeasible(pr, budget, e, memory_limit_bytes=o.memory_limit_bytes) from e
    plan = choose_data_method(plan, pr.law, methods=data_methods, fractions=o.data_fractions,
                              fits=o.data_quality)
    plan = with_calibration(with_model_facts(with_feature_notes(plan, pr.graph), model), calibration)
    return with_hw_source(replace(with_planned_lr(plan, o.lr), options=o.recorded()), hw)


def with_planned_lr(plan: Plan, lr: float | None) -> Plan:
    """`plan` with its peak learning rate from `trainplan.costmodels.loss.planned.planned_lr` at its
    compute when `lr` is None (DeepSeek LLM's law from 1e17 FLOPs up, with a note giving the law's
    rate and batch, and its warmup: `planned_warmup_steps`, the predicted loss moved to it); with a
    warning when a given `lr` is far from the law's (`lr_warning`)."""
    c = plan.compute_flops
    if c <= 0:
        return plan
    if lr is not None:
        warning = lr_warning(lr, c)
        return replace(plan, warnings=(*plan.warnings, warning)) if warning else plan
    if c < LAW_MIN_FLOPS:
        return plan
    new, d, p = planned_lr(c), plan.decisions, plan.predictions
    warmup = planned_warmup_steps(d.max_steps, c)
    loss = p.final_loss
    if p.loss_law and warmup != d.warmup_steps:  # the warmup's lost area (`run_loss`), moved to the new warmup
        law = law_from_fields(p.loss_law)
        unique = max(1.0, d.data_fraction * plan.data_tokens) if plan.data_tokens else None

        def at(w: int) -> float:
            return run_loss(law, plan.law_n_params, steps=d.max_steps, tokens_per_step=p.tokens_per_step,
                            unique_tokens=unique, warmup_steps=w)

        loss += at(warmup) - at(d.warmup_steps)
    note = (f"peak learning rate {new:.3g} and {warmup:,} warmup steps from DeepSeek LLM's hyperparameter law at "
            f"{c:.3g} FLOPs (Bi et al. 2024, "
            f"arXiv:2401.02954, eq. 1: 0.3118 C^-0.125; its batch, 0.2920 C^0.3271 = {law_batch_tokens(c):,.0f} "
            f"tokens, beside this plan's {plan.predictions.tokens_per_step:,})")
    return replace(plan, decisions=replace(d, lr=new, warmup_steps=warmup),
                   predictions=replace(p, final_loss=loss), notes=(*plan.notes, note))


def with_hw_source(plan: Plan, hw: str | HardwareProfile) -> Plan:
    """`plan` with `hw_source(hw)` added to its options (unchanged for a shipped profile)."""
    extra = hw_source(hw)
    return replace(plan, options={**(plan.options or {}), **extra}) if extra else plan


def hw_source(hw: str | HardwareProfile) -> dict[str, str]:
    """`{HW_FROM_FILE: ...}` for a profile that is not a shipped one (a .toml path, or a
    `HardwareProfile` of another name: "python"), else {}: a plan file's loader accepts an `hw` it
    does not know by name only with it (`trainplan.planner.plan.implausible`)."""
    from trainplan.hardware_profiles import known_names

    if isinstance(hw, str) and hw.strip().lower().endswith(".toml"):
        return {HW_FROM_FILE: hw}
    if isinstance(hw, HardwareProfile) and hw.name not in known_names():
        return {HW_FROM_FILE: "python"}
    return {}


def with_feature_notes(plan: Plan, graph) -> Plan:
    """`plan` with the notes its model's features call for: why SP above 1 was not offered,
    when the model's attention is one Ulysses cannot run (`trainplan.planner.capture.layout.sp_refusal`)
    and the plan has devices to share a sequence over; and, for a mixture of experts, where its
    experts are (no expert parallelism: on every device, their states sharded by the ZeRO stage)."""
    notes = []
    why = sp_refusal(graph.features)
    if why and plan.decisions.devices > 1:
        notes.append(f"sp_degree 1 only: {why}")
    experts = next((f.split("=")[1] for f in graph.features if f.startswith("experts=")), None)
    if experts is not None:
        d = plan.decisions
        where = ("sharded by ZeRO-3 across the devices, gathered per block" if d.zero_stage == 3 and d.devices > 1
                 else f"replicated on every device (ZeRO-{d.zero_stage}"
                      + {1: ": optimizer states sharded)", 2: ": optimizer states and gradients sharded)"}.get(
                          d.zero_stage if d.devices > 1 else 0, ")"))
        notes.append(f"mixture of {experts} experts: no expert parallelism; experts {where}")
        notes.append(f"mixture of experts: the loss law is evaluated at the {graph.n_active_params:,} parameters a "
                     f"token runs through (of {graph.n_params:,}), as a dense model of that size: an upper "
                     "estimate, since routed models beat dense ones of equal active parameters (Clark et al. "
                     "2022, arXiv:2202.01169; Krajewski et al. 2024, arXiv:2402.07871, for fine-grained experts)")
    new = tuple(n for n in notes if n not in plan.warnings)
    return replace(plan, warnings=plan.warnings + new) if new else plan


def solve_longest(model: nn.Module | str, hw: str | HardwareProfile, budget: Budget, *,
                  up_to: int = MAX_TOKENS, granularity: int = GRANULARITY_TOKENS, data_tokens: int | None = None,
                  vocab_size: int | None = None, precision: str | None = None, law: LossLaw | None = None,
                  time_limit_s: float = 10.0, seed: int = 0, memory_limit_bytes: float | None = None,
                  **space_options) -> Plan:
    """The plan for the longest sequence `budget` trains (`trainplan.planner.joint.problem.longest_plan`: the
    longest multiple of `granularity` tokens, at most `up_to`, with a plan; every knob chosen
    jointly at each length, the long-context knobs where nothing fits without them).
    `space_options`: `solve`'s search-space options (micro_batches, optimizer_bits,
    activation_bits, policies, data_fractions, global_batch_tokens, loss_chunks, mlp_chunks,
    offload).

    Raises:
        as `solve`; InfeasibleError when not even `granularity` tokens fit."""
    if not isinstance(budget, Budget):
        raise TrainplanError(f"budget must be a trainplan.planner.Budget, got {type(budget).__name__}")
    check_time_limit(time_limit_s)
    check_seed(seed)
    if space_options.get("global_batch_tokens") is not None:
        raise TrainplanError("a global batch and the longest sequence cannot be planned together: a global batch "
                             "divides into micro-steps at some lengths only, so the longest one is not found by "
                             "bisection; leave global_batch_tokens out (or solve at a --seq-len)")
    pr = prepare(model, hw, seq_len=granularity, data_tokens=data_tokens, vocab_size=vocab_size,
                 precision=precision, law=law, **space_options)
    plan = longest_plan(pr, budget, granularity=granularity, up_to=up_to, time_limit_s=time_limit_s, seed=seed,
                        memory_limit_bytes=memory_limit_bytes)
    return with_hw_source(with_model_facts(with_feature_notes(plan, pr.graph), model), hw)


def with_model_facts(plan: Plan, model: nn.Module | str) -> Plan:
    """`plan` with what its model adds to it: the transformers config a config-built module
    carries (`Plan.hf_config`, from `trainplan.modeling.configs.build_from_config`), a warning naming the
    fields such a config left to its class's defaults (`trainplan.modeling.configs.defaults_warning`), and a
    warning when the plan's sequence is beyond the positions the model was configured for
    (`trainplan.modeling.configs.position_warning`, presets included). `solve`, `solve_longest` and
    `plan_for_choice` apply it; applied twice, it adds nothing more.

    Raises:
        TrainplanError: the sequence is beyond a learned position table (an `nn.Embedding` with
            as many rows as the model's positions, GPT-2's `wpe`): a run would index past it."""
    config = getattr(model, "trainplan_config", None) if isinstance(model, nn.Module) else None
    limit = max_positions(model)
    if isinstance(model, nn.Module) and limit is not None and plan.decisions.seq_len > limit:
        table = next((n for n, m in model.named_modules() if isinstance(m, nn.Embedding)
                      and m.num_embeddings == limit and m.num_embeddings != plan.vocab_size), None)
        if table is not None:
            raise TrainplanError(
                f"seq_len={plan.decisions.seq_len} is beyond {plan.model}'s {limit} learned positions ({table}, an "
                f"nn.Embedding of {limit} rows): a run would index past the table; use seq_len <= {limit}")
    defaults = getattr(model, "trainplan_config_warning", "") if isinstance(model, nn.Module) else ""
    found = (defaults, position_warning(plan.model, max_positions(model), plan.decisions.seq_len))
    warnings = plan.warnings + tuple(w for w in found if w and w not in plan.warnings)
    return replace(plan, warnings=warnings, hf_config=config if isinstance(config, dict) else plan.hf_config)


def plan_for_choice(model: nn.Module | str, hw: str | HardwareProfile, *, seq_len: int,
                    micro_batch: int, grad_accum: int = 1, activation_checkpoint: tuple[str, ...] | str = "none",
                    checkpoint_sets: dict[str, list[str]] | None = None, sp_degree: int = 1,
                    devices: int = 1, zero_stage: int = 0, optimizer_bits: int | None = None,
                    activation_bits: int = 32, precision: str | None = None, data_fraction: float = 1.0,
                    max_steps: int = 10,
                    data_tokens: int | None = None, vocab_size: int | None = None,
                    law: LossLaw | None = None, lr: float = 3e-3, seed: int = 0,
                    data_method: str = "random", selection_every_steps: int = 0,
                    loss_chunks: int = 1, mlp_chunks: int = 1, offload: bool = False) -> Plan:
    """A Plan with every knob fixed by the caller, predictions from the same cost models, no
    solver (status `FIXED`): for baselines, benchmarks and what-if questions. `data_method`
    and `selection_every_steps` (dynamic selection) as `trainplan.planner.data_choice.with_data_method`
    sets them: nothing is taken off `max_steps` for scoring. `grad_accum`: micro-steps of
    `micro_batch` sequences per optimizer step; `max_steps` counts optimizer steps.
    `loss_chunks`, `mlp_chunks`, `offload`: the long-context knobs (`trainplan.planner.plan.Decisions`).

    Raises:
        TrainplanError: a knob out of range (SP degree not dividing devices, heads or sequence;
            unknown policy; ZeRO stage; bits; grad_accum or a chunk count not a whole number
            >= 1; a tiled MLP under a selective checkpoint entry).
    """
    check_seq_len(seq_len)
    loss_chunks = check_chunk_options(check_chunks(loss_chunks, what="loss_chunks"), "loss_chunks")[0]
    mlp_chunks = check_chunk_options(check_chunks(mlp_chunks, what="mlp_chunks"), "mlp_chunks")[0]
    if not isinstance(offload, bool):
        raise TrainplanError(f"offload={offload!r} must be True or False")
    for what, value in (("max_steps", max_steps), ("grad_accum", grad_accum)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise TrainplanError(f"{what}={value!r} must be a whole number >= 1")
    profile, precision, graph, name, step_model = setup_model(model, hw, precision=precision,
                                                              vocab_size=vocab_size,
                                                              activation_bits=(activation_bits,), seq_len=seq_len)
    valid_bits = optimizer_bits_for(precision)
    optimizer_bits = valid_bits[0] if optimizer_bits is None else optimizer_bits
    if isinstance(optimizer_bits, bool) or optimizer_bits not in valid_bits:
        raise TrainplanError(f"optimizer_bits={optimizer_bits!r} cannot run with precision={precision!r}: "
                             f"use {', '.join(map(str, valid_bits))}")
    policies = ((activation_checkpoint,) * graph.n_layers if isinstance(activation_checkpoint, str)
                else tuple(activation_checkpoint))
    if len(policies) != graph.n_layers:
        raise TrainplanError(f"activation_checkpoint has {len(policies)} entries; {name} has {graph.n_layers} layers")
    sets = sets_from_mapping(checkpoint_sets)
    for p in policies:
        check_policy(p, sets)
    valid = [p for p in comm.valid_sp_degrees(seq_len, graph.n_heads, graph.n_kv_heads) if devices % p == 0]
    if sp_degree > 1 and sp_refusal(graph.features):
        raise TrainplanError(f"sp_degree={sp_degree} cannot run {name}: {sp_refusal(graph.features)}; use sp_degree=1")
    if sp_degree not in valid:
        raise TrainplanError(f"sp_degree={sp_degree} is not valid for devices={devices}, seq_len={seq_len} "
                             f"and {graph.n_heads} heads: valid degrees are {valid}")
    for what, chunks in (("loss_chunks", loss_chunks), ("mlp_chunks", mlp_chunks)):
        if isinstance(micro_batch, int) and chunks > micro_batch * seq_len // sp_degree:
            raise TrainplanError(f"{what}={chunks} is more chunks than a micro-batch has tokens on one rank "
                                 f"(micro_batch x seq_len / sp_degree = {micro_batch * seq_len // sp_degree}): "
                                 "use at most that many")
    choice = Choice(sp_degree=sp_degree, zero_stage=zero_stage, micro_batch=micro_batch, seq_len=seq_len,
                    policies=policies, precision=precision, optimizer_bits=optimizer_bits, devices=devices,
                    activation_bits=activation_bits, grad_accum=grad_accum, loss_chunks=loss_chunks,
                    mlp_chunks=mlp_chunks, offload=offload,
                    sets=tuple(x for x in sets.values() if x.name in policies))
    law = loss_law_for(law, profile, name, graph)
    unique = data_tokens if data_tokens is not None else UNLIMITED_DATA_TOKENS
    tokens = max_steps * micro_batch * seq_len * (devices // sp_degree) * grad_accum
    loss = run_loss(law, graph.law_n_params, steps=max_steps, tokens_per_step=tokens // max_steps,
                    unique_tokens=max(1.0, data_fraction * unique))
    loss += bits_loss_penalty(optimizer_bits, activation_bits, precision=precision, penalty=law.bits)
    facts = SolverFacts(status="FIXED", objective=0.0, bound=0.0, wall_s=0.0, seed=seed, time_limit_s=0.0)
    plan = make_plan(step_model, profile, graph, name, choice, budget={"devices": devices, "fixed_steps": max_steps},
                     data_fraction=data_fraction, max_steps=max_steps, predicted_loss=loss,
                     unique=unique, law=law, lr=lr, seed=seed, facts=facts, memory_limit_bytes=None)
    plan = with_hw_source(with_model_facts(with_feature_notes(plan, graph), model), hw)
    if data_method == "random" and selection_every_steps == 0:
        return plan
    return with_data_method(plan, data_method, selection_every_steps=selection_every_steps, law=law)
