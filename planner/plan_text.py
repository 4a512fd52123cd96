"""The plan as text: the block of lines `trainplan solve` prints (decisions, memory, step, run,
governor, solver, warnings), shared by the command line (`trainplan.planner.cli.plan_text.print_plan`)
and `str(plan)` (`trainplan.planner.plan.Plan.__str__`).

It reads the plan's fields only (no import of `trainplan.planner.plan`: `Plan.__str__` imports this).
"""

from __future__ import annotations

from typing import Any

__all__ = ["plan_summary"]


def _free_text(plan: Any) -> str:
    """"; leaves X GiB of the device's Y GiB free" for a plan of a shipped GPU profile (its
    `hbm_bytes`: what the allocator's fragmentation, the CUDA context and communication buffers
    share; the profile's `memory_reserve_bytes` is the planned part of it); "" otherwise."""
    from trainplan.hardware_profiles import known_names, load

    if plan.hw == "cpu" or plan.hw not in known_names():
        return ""
    hbm = float(load(plan.hw).hbm_bytes)
    free = hbm - plan.predictions.memory_bytes["total"]
    return f"; leaves {free / 2**30:.2f} GiB of the device's {hbm / 2**30:.2f} GiB free"


def plan_summary(plan: Any) -> str:
    """`plan` (a `trainplan.planner.plan.Plan`) as `trainplan solve` shows it: decisions, memory,
    step, run, governor, solver and its warnings (`Plan.warnings`), one line each, no trailing
    newline."""
    out: list[str] = []
    d, p = plan.decisions, plan.predictions
    ck = {e: d.activation_checkpoint.count(e) for e in dict.fromkeys(d.activation_checkpoint)}
    gib = 2**30
    out.append(f"plan: {plan.model} ({plan.model_n_params / 1e9:.3g}B params, {plan.model_n_layers} layers) "
          f"on {d.devices} x {plan.hw}, seq_len {d.seq_len}")
    out.append(f"  decisions: sp_degree={d.sp_degree} dp_degree={d.dp_degree} zero_stage={d.zero_stage} "
          f"micro_batch={d.micro_batch} grad_accum={d.grad_accum} precision={d.precision} "
          f"optimizer_bits={d.optimizer_bits} activation_bits={d.activation_bits}")
    out.append(f"             checkpoint per block: {', '.join(f'{n} x {e}' for e, n in ck.items())}")
    if d.loss_chunks > 1 or d.mlp_chunks > 1 or d.offload:
        host = (f" ({p.host_memory_bytes / gib:.2f} GiB of {p.host_memory_limit_bytes / gib:.2f} host memory)"
                if d.offload and p.host_memory_limit_bytes else "")
        out.append(f"             long context: loss_chunks={d.loss_chunks} mlp_chunks={d.mlp_chunks} "
              f"offload={d.offload}{host}")
    out.append(f"             data_fraction={d.data_fraction} ({d.data_method}) max_tokens={d.max_tokens:,} "
          f"max_steps={d.max_steps:,}")
    if p.scoring_flops > 0 or d.selection_every_steps:
        when = (f"re-scored every {d.selection_every_steps} steps" if d.selection_every_steps
                else "scored once before training")
        out.append(f"             data selection: {d.data_method}, {when}; {p.scoring_flops:.3g} scoring "
              "FLOPs charged to the budget")
    mem = ", ".join(f"{k} {v / gib:.2f}" for k, v in p.memory_bytes.items() if k != "total")
    out.append(f"  memory/device: {p.memory_bytes['total'] / gib:.2f} GiB of {p.memory_limit_bytes / gib:.2f} "
               f"usable (peak at {p.memory_phase}; GiB: {mem}){_free_text(plan)}")
    br = ", ".join(f"{'exposed communication' if k == 'communication' else k} {v:.3g}"
                   for k, v in p.step_time_breakdown_s.items())
    out.append(f"  step: {p.step_time_s:.4g} s ({br}), {p.flops_per_step:.3e} FLOPs/device, "
          f"{p.tokens_per_step:,} tokens, MFU {p.mfu:.1%}")
    band = f" +- {p.loss_band_nats:.2g}" if p.loss_band_nats else ""
    regime = f" ({p.loss_regime})" if p.loss_regime else ""
    out.append(f"  run: {p.total_tokens:,} tokens, {p.device_hours:.4g} device-hours, predicted final loss "
          f"{p.final_loss:.3f}{band} nats{regime}")
    law_lr = next((n for n in plan.notes if "DeepSeek LLM's hyperparameter law" in n), "")
    out.append(f"  schedule: peak lr {d.lr:.3g}, {d.warmup_steps:,} warmup steps, warmup-stable-decay"
               + (" (DeepSeek LLM's law, Bi et al. 2024)" if law_lr else ""))
    cal = p.loss_calibration
    if cal:
        pilots = f"; pilots {cal['pilot_flops']:.3g} FLOPs, {cal['pilot_s']:.0f} s" if cal.get("ran") else ""
        out.append(f"  loss law: {cal.get('why', '')}{pilots}")
    if d.governor_threshold > 0 and p.predicted_stop_step is not None:
        if p.predicted_stop_step >= d.max_steps:
            when = f"the budget binds first ({d.max_steps:,} steps)"
        elif p.predicted_end_step is not None and p.predicted_end_step > p.predicted_stop_step:
            when = (f"predicted stop at step {p.predicted_stop_step:,} of {d.max_steps:,}, cooldown to "
                    f"{p.predicted_end_step:,}")
        else:
            when = (f"predicted stop at step {p.predicted_stop_step:,} of {d.max_steps:,}, at once "
                    "(held-out loss no longer falling)")
        out.append(f"  governor: stop below {d.governor_threshold:.3g} nats/step of loss drop; {when}; "
              f"end loss {p.predicted_end_loss:.3f} nats")
        picked = next((n for n in plan.notes if "picked from the curve" in n), None)
        if picked:
            out.append("  budget: " + picked[picked.index("budget ") + len("budget "):].split(";")[0])
    s = plan.solver
    status = s.status
    if s.status == "FEASIBLE":  # the time limit ended the search: best found, not proven optimal
        status += f" (not optimal, gap {s.gap:.3%})"
    # the limit is CP-SAT's deterministic time (work, not seconds: the same plan under any load);
    # the wall time beside it is what this solve took here
    out.append(f"  solver: {status} in {s.wall_s:.2f} s wall (limit {s.time_limit_s:g} deterministic s; "
          f"objective {s.objective:.4f} nats predicted loss, bound {s.bound:.4f}, seed {s.seed})")
    for warning in plan.warnings:  # e.g. a sequence beyond the model's positions: one line each
        out.append(f"  warning: {warning}")
    return "\n".join(out)
