"""The loss law applied to a planned run: its steps, batch and warmup, as the executor trains it.

`trainplan.costmodels.loss.law.LossLaw.predict` takes tokens, a batch and a warmup; a plan has optimizer
steps of `tokens_per_step` tokens and the executor's warmup-stable-decay schedule (linear warmup
over `warmup_steps_for(max_steps)` steps unless the user sets one, constant, linear cooldown over
the last 20%: `trainplan.executor.apply.applied.lr_at`). `run_loss` is the one place that turns the first
into the second, so the solver's table, the plan's prediction, the data-method choice and the
benchmarks predict the same number for the same run.
"""

from __future__ import annotations

from trainplan.costmodels.checks import check_positive

#: Default warmup of a plan: a tenth of its optimizer steps, at least 1 and at most 20 (this
#: project's rule; the plan records it and `--warmup-steps` overrides it).
MAX_DEFAULT_WARMUP_STEPS = 20


def warmup_steps_for(max_steps: int) -> int:
    """The default warmup of a plan of `max_steps` optimizer steps: max(1, min(20, max_steps // 10))."""
    return max(1, min(MAX_DEFAULT_WARMUP_STEPS, int(max_steps) // 10))


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
