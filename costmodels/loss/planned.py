"""The loss law applied to a planned run: its steps, batch and warmup, as the executor trains it.

`trainplan.costmodels.loss.law.LossLaw.predict` takes tokens, a batch and a warmup; a plan has optimizer
steps of `tokens_per_step` tokens and the executor's warmup-stable-decay schedule (linear warmup
over `warmup_steps_for(max_steps)` steps unless the user sets one, constant, linear cooldown over
the last 20%: `trainplan.executor.apply.applied.lr_at`). `run_loss` is the one place that turns the first
into the second, so the solver's table, the plan's prediction, the data-method choice and the
benchmarks predict the same number for the same run.

It also holds the plan's default peak learning rate (`planned_lr`, DeepSeek LLM's hyperparameter
law from 1e17 FLOPs up) and the warning for a rate far from it (`lr_warning`): the law assumes a
well-tuned rate.
"""

from __future__ import annotations

from trainplan.costmodels.checks import check_positive

#: Default warmup of a plan: a tenth of its optimizer steps, at least 1 and at most 20 (this
#: project's rule; the plan records it and `--warmup-steps` overrides it).
MAX_DEFAULT_WARMUP_STEPS = 20


def warmup_steps_for(max_steps: int) -> int:
    """The default warmup of a plan of `max_steps` optimizer steps: max(1, min(20, max_steps // 10))."""
    return max(1, min(MAX_DEFAULT_WARMUP_STEPS, int(max_steps) // 10))


#: DeepSeek LLM (Bi et al. 2024, arXiv:2401.02954), Sec. 3.1, eq. 1: the near-optimal peak learning
#: rate eta_opt = 0.3118 C^-0.1250 and batch B_opt = 0.2920 C^0.3271 tokens, C the training compute in
#: FLOPs; they trained their 7B and 67B models with the rates it gives (4.2e-4 and 3.2e-4).
DEEPSEEK_LR = (0.3118, -0.1250)
DEEPSEEK_BATCH_TOKENS = (0.2920, 0.3271)
#: The law is applied from this compute up (the smallest budget of DeepSeek's hyperparameter
#: experiments, 1e17 FLOPs, Sec. 3.1); below it, as in every CPU run of this project (pilots,
#: benchmarks, the demo), the plan keeps `SMALL_RUN_LR`.
LAW_MIN_FLOPS = 1e17
SMALL_RUN_LR = 3e-3
#: DeepSeek LLM's warmup (Sec. 2.3: the rate reaches its peak after 2000 steps), used from
#: `LAW_MIN_FLOPS` up, capped at a tenth of the steps (`planned_warmup_steps`).
LAW_WARMUP_STEPS = 2000
#: A user's learning rate more than this factor from the law's is warned about (`lr_warning`).
LR_WARN_FACTOR = 3.0


def law_lr(compute_flops: float) -> float:
    """DeepSeek LLM's near-optimal peak learning rate at `compute_flops` (training FLOPs, > 0):
    0.3118 C^-0.125 (Bi et al. 2024, eq. 1). Raises: TrainplanError on a non-positive compute."""
    c = check_positive("compute_flops", compute_flops)
    return DEEPSEEK_LR[0] * c ** DEEPSEEK_LR[1]


def law_batch_tokens(compute_flops: float) -> float:
    """DeepSeek LLM's near-optimal global batch at `compute_flops` (training FLOPs, > 0), tokens:
    0.2920 C^0.3271 (Bi et al. 2024, eq. 1). Raises: TrainplanError on a non-positive compute."""
    c = check_positive("compute_flops", compute_flops)
    return DEEPSEEK_BATCH_TOKENS[0] * c ** DEEPSEEK_BATCH_TOKENS[1]


def planned_lr(compute_flops: float) -> float:
    """A plan's default peak learning rate at `compute_flops` (training FLOPs): `law_lr` from
    `LAW_MIN_FLOPS` up, `SMALL_RUN_LR` below. Raises: TrainplanError on a non-positive compute."""
    return law_lr(compute_flops) if compute_flops >= LAW_MIN_FLOPS else SMALL_RUN_LR


def planned_warmup_steps(max_steps: int, compute_flops: float) -> int:
    """A plan's default warmup: from `LAW_MIN_FLOPS` up, DeepSeek LLM's 2000 steps, at most a tenth of
    `max_steps` (at least 1); below, `warmup_steps_for` (this project's 20)."""
    if compute_flops < LAW_MIN_FLOPS:
        return warmup_steps_for(max_steps)
    return max(1, min(LAW_WARMUP_STEPS, int(max_steps) // 10))


def lr_warning(lr: float, compute_flops: float) -> str:
    """A warning when `lr` is more than `LR_WARN_FACTOR` from `law_lr` at `compute_flops` (from
    `LAW_MIN_FLOPS` up; below, the law is outside its range and nothing is said); "" otherwise.
    Args: lr (peak learning rate, > 0), compute_flops (training FLOPs)."""
    if compute_flops < LAW_MIN_FLOPS:
        return ""
    want = law_lr(compute_flops)
    if max(lr / want, want / lr) <= LR_WARN_FACTOR:
        return ""
    return (f"peak learning rate {lr:.3g} is {max(lr / want, want / lr):.3g}x {'above' if lr > want else 'below'} "
            f"{want:.3g}, DeepSeek LLM's near-optimal rate at {compute_flops:.3g} FLOPs (Bi et al. 2024, eq. 1): "
            "the predicted loss assumes a well-tuned rate, so it is likely too low for this run")


def run_loss(law, n_params: float, *, steps: float, tokens_per_step: float, unique_tokens: float | None = None,
             quality: float = 1.0, warmup_steps: int | None = None) -> float:
    """Predicted final held-out loss (nats/token) of a run of `steps` optimizer steps of
    `tokens_per_step` tokens (the global batch: micro-batch x sequence x data-parallel ranks x
    accumulation) under `law` (a `trainplan.costmodels.loss.law.LossLaw`): `law.predict` at steps x tokens
    seen, that batch, and a warmup of `warmup_steps` steps (default `warmup_steps_for(steps)`).

    Raises: TrainplanError on a non-positive steps or batch (and `LossLaw.predict`'s errors).
    """
    s = check_positive("steps", steps)
    g = check_positive("tokens_per_step", tokens_per_step)
    w = warmup_steps_for(int(s)) if warmup_steps is None else warmup_steps
    return law.predict(n_params, s * g, unique_tokens, quality, batch_tokens=g, warmup_tokens=min(w, s) * g)
