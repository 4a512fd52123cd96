"""`solve()`: model x hardware x budget -> Plan."""

from __future__ import annotations

import datetime as _dt
import math

import torch
from torch import nn

from costmodels.loss import LossLaw
from costmodels.step import StepModel
from hardware_profiles import HardwareProfile, load as load_profile
from hardware_profiles.errors import TrainplanError
from planner.budget import Budget
from planner.capture import ModelGraph, capture
from planner.plan import Decisions, Plan, Predictions, SolverFacts
from planner.presets import build_model, get_preset
from planner.solver import default_space, solve_joint

UNLIMITED_DATA_TOKENS = 15 * 10**12
"""Default unique tokens when no corpus size is given: Llama 3's 15T pre-training tokens
(Meta, "The Llama 3 Herd of Models", 2024), i.e. no repetition for any plan here."""


def default_precision(hw: HardwareProfile) -> str:
    """fp32 on CPUs (bf16 matmuls are slow there), bf16 mixed precision on accelerators."""
    return "fp32" if hw.device_type == "cpu" else "bf16-mixed"


def capture_model(model: nn.Module | str, precision: str, *, vocab_size: int | None = None) -> tuple[ModelGraph, str, tuple[int, ...]]:
    """Build (if a preset name) and capture `model` on the meta device.

    Returns the graph, the model's name and its parameter tensor sizes."""
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    if isinstance(model, str):
        get_preset(model)  # typed error for unknown names
        module = build_model(model, device="meta", dtype=dtype, vocab_size=vocab_size)
        name = model
    elif isinstance(model, nn.Module):
        module, name = model, getattr(model, "trainplan_preset", type(model).__name__)
    else:
        raise TrainplanError(f"model must be an nn.Module or a preset name, got {type(model).__name__}")
    graph = capture(module, dtype=dtype, name=name)
    return graph, name, tuple(p.numel() for p in module.parameters())


def solve(model: nn.Module | str, hw: str | HardwareProfile, budget: Budget, *, seq_len: int = 2048,
          data_tokens: int | None = None, vocab_size: int | None = None, precision: str | None = None,
          law: LossLaw | None = None, micro_batches=(1, 2, 4, 8, 16), optimizer_bits=(32, 8),
          policies=("none", "save_matmuls", "save_attention", "full"),
          data_fractions=(0.25, 0.5, 0.75, 1.0), time_limit_s: float = 10.0, seed: int = 0,
          lr: float = 3e-3, export_path: str | None = None) -> Plan:
    """Plan a training run: every knob chosen jointly by one CP-SAT model.

    Args:
        model: an `nn.Module` (HF-style causal LM) or a preset name (`trainplan profiles`
            lists hardware, `planner.presets.known_presets()` models).
        hw: hardware profile name or alias (`mi300`, `h100`, `cpu`, ...) or a profile.
        budget: device-hours, wall-clock seconds or FLOPs, and the device count.
        seq_len: tokens per sequence.
        data_tokens: unique training tokens in the corpus (None: unconstrained).
        vocab_size: overrides the preset's vocabulary (a run uses its tokenizer's).

    Raises:
        UnknownNameError: unknown hardware or preset.
        TrainplanError: bad sequence length, SP degree or option.
        InfeasibleError: nothing fits; the message names the binding term and what to relax.
    """
    profile = load_profile(hw)
    if not isinstance(seq_len, int) or seq_len < 1:
        raise TrainplanError(f"seq_len={seq_len!r} must be a positive whole number of tokens")
    if not isinstance(budget, Budget):
        raise TrainplanError(f"budget must be a planner.Budget, got {type(budget).__name__}")
    precision = precision or default_precision(profile)
    graph, name, numels = capture_model(model, precision, vocab_size=vocab_size)
    step_model = StepModel(graph.regions, graph.blocks, numels, profile, n_heads=graph.n_heads,
                           n_kv_heads=graph.n_kv_heads, head_dim=graph.head_dim)
    space = default_space(devices=budget.devices, seq_len=seq_len, n_heads=graph.n_heads,
                          n_kv_heads=graph.n_kv_heads, precision=precision,
                          micro_batches=micro_batches, optimizer_bits=optimizer_bits,
                          policies=policies, data_fractions=data_fractions)
    if not space.sp_degrees:
        raise TrainplanError(
            f"no sequence-parallel degree divides devices={budget.devices}, seq_len={seq_len} and "
            f"{graph.n_heads} attention heads; use a device count or sequence length they share")
    law = law or LossLaw.besiroglu2024()
    unique = data_tokens if data_tokens is not None else UNLIMITED_DATA_TOKENS
    sol = solve_joint(step_model, profile, budget, seq_len=seq_len, space=space,
                      n_params=graph.n_params, data_tokens=unique, law=law,
                      time_limit_s=time_limit_s, seed=seed, export_path=export_path)
    c = sol.choice
    cost = step_model.evaluate(c)
    steps = sol.max_steps
    total_flops_dev = cost.flops * steps
    peak_flops = profile.peak(PRECISION_DTYPE[precision])
    decisions = Decisions(
        devices=budget.devices, sp_degree=c.sp_degree, dp_degree=budget.devices // c.sp_degree,
        zero_stage=c.zero_stage, micro_batch=c.micro_batch, seq_len=seq_len, checkpoint=c.policies,
        precision=precision, optimizer_bits=c.optimizer_bits, data_fraction=sol.data_fraction,
        data_method="random", max_tokens=sol.total_tokens, max_steps=steps, governor_threshold=0.0,
        lr=lr, warmup_steps=max(1, min(20, steps // 10)), seed=seed)
    predictions = Predictions(
        memory_bytes=cost.memory.as_dict(), memory_phase=cost.memory.phase,
        memory_limit_bytes=float(profile.usable_bytes), step_time_s=cost.time_s,
        step_time_breakdown_s={"compute": cost.compute_s, "recompute": cost.recompute_s,
                               "communication": cost.comm_s},
        flops_per_step=cost.flops, model_flops_per_step=cost.model_flops,
        tokens_per_step=sol.tokens_per_step, total_tokens=sol.total_tokens,
        device_hours=cost.time_s * steps * budget.devices / 3600.0, final_loss=sol.predicted_loss,
        mfu=cost.model_flops / (cost.time_s * peak_flops) if cost.time_s > 0 else 0.0)
    facts = SolverFacts(status=sol.status, objective=sol.objective, bound=sol.bound, wall_s=sol.wall_s,
                        seed=seed, time_limit_s=time_limit_s, n_variables=sol.n_variables,
                        n_constraints=sol.n_constraints)
    notes = ("communication is added to compute, not overlapped: a conservative time bound",
             f"loss law: {law.source}")
    if not math.isfinite(total_flops_dev):
        raise TrainplanError("predicted FLOPs are not finite; the captured graph is broken")
    return Plan(model=name, model_n_params=graph.n_params, model_n_layers=graph.n_layers,
                hw=profile.name, budget=budget.to_dict() | {"seq_len": seq_len},
                data_tokens=int(unique), vocab_size=graph.vocab_size, decisions=decisions,
                predictions=predictions, solver=facts,
                created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                notes=notes)


PRECISION_DTYPE = {"fp32": "fp32", "bf16-mixed": "bf16", "bf16": "bf16"}
