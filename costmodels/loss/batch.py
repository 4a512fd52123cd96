"""Batch size in the loss law: the critical batch size and the tokens a batch wastes.

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training" (arXiv:1812.06162),
Sec. 2.2: to reach a given loss, the optimizer steps S and the training examples E of
runs at different batch sizes trade as (S / S_min - 1)(E / E_min - 1) = 1, with S_min the fewest
steps (infinite batch) and E_min the fewest examples (batch -> 0); B_crit = E_min / S_min.
Kaplan et al. 2020, "Scaling Laws for Neural Language Models" (arXiv:2001.08361), Sec. 5.1: a
run at batch B (tokens) for S steps and E = B S tokens is worth

    S_min = S / (1 + B_crit / B)          E_min = E / (1 + B / B_crit),

so the law sees E_min ("effective tokens") where it saw tokens. The limits:

- B << B_crit: E_min -> E. Every token counts; a smaller batch only costs more (serial) steps,
  S = S_min (1 + B_crit / B): what a small batch pays for its tokens is steps.
- B >> B_crit: E_min -> S B_crit. Only steps count; the tokens beyond B_crit in each step are
  wasted: what a large batch pays for its steps is tokens.

The critical batch grows as the loss falls (Kaplan et al. 2020, Sec. 5.1 and Table 4):
B_crit(L) = B_* / L^(1 / alpha_B), B_* ~ 2.1e8 tokens, alpha_B ~ 0.21, L in nats per token of
their tokenizer (GPT-2's byte-level BPE on WebText2). Carried to another tokenizer per byte
(`trainplan.costmodels.loss.transfer`): the loss per byte and the batch in bytes are what compare.
A locally fitted law replaces B_* by its own constant (`trainplan.costmodels.loss.pilots`).
"""

from __future__ import annotations

import numpy as np

from trainplan.costmodels.checks import check_positive

#: Kaplan et al. 2020, Table 4 / Sec. 5.1: B_crit(L) = B_* / L^(1/alpha_B), tokens.
KAPLAN_B_STAR_TOKENS = 2.1e8
#: Kaplan et al. 2020, Table 4 / Sec. 5.1: the exponent alpha_B (dimensionless).
KAPLAN_ALPHA_B = 0.21
#: Bytes per token of Kaplan et al.'s data: WebText2, 96 GB of text in 2.29e10 GPT-2 BPE
#: tokens (Kaplan et al. 2020, Sec. 2.3): 96e9 / 2.29e10 = 4.19 bytes per token.
KAPLAN_BYTES_PER_TOKEN = 96e9 / 2.29e10


def critical_batch_tokens(loss_nats_per_token: float, *, bytes_per_token: float = KAPLAN_BYTES_PER_TOKEN,
                          b_star_tokens: float = KAPLAN_B_STAR_TOKENS,
                          alpha_b: float = KAPLAN_ALPHA_B) -> float:
    """The critical batch, in tokens of the tokenizer with `bytes_per_token`, at a loss of
    `loss_nats_per_token` in that tokenizer's nats.

    Kaplan et al. 2020 Sec. 5.1, B_crit = B_* / L^(1/alpha_B), evaluated in Kaplan's units: the
    loss per byte times KAPLAN_BYTES_PER_TOKEN is their L; their B_crit in tokens times
    KAPLAN_BYTES_PER_TOKEN / bytes_per_token is ours (the same bytes per step). With the default
    `bytes_per_token` it is their formula as printed.

    Args: loss_nats_per_token (> 0), bytes_per_token (> 0), b_star_tokens (tokens, > 0),
    alpha_b (> 0).
    Returns: tokens per optimizer step.
    Raises: TrainplanError on a non-positive or non-finite input.
    """
    loss = check_positive("loss_nats_per_token", loss_nats_per_token)
    bpt = check_positive("bytes_per_token", bytes_per_token)
    b_star = check_positive("b_star_tokens", b_star_tokens)
    a = check_positive("alpha_b", alpha_b)
    loss_kaplan = loss / bpt * KAPLAN_BYTES_PER_TOKEN
    return float(b_star / loss_kaplan ** (1.0 / a) * KAPLAN_BYTES_PER_TOKEN / bpt)


def batch_efficiency(batch_tokens: float | np.ndarray, b_crit_tokens: float | np.ndarray) -> float | np.ndarray:
    """E_min / E = 1 / (1 + B / B_crit) (Kaplan et al. 2020 Sec. 5.1; McCandlish et al. 2018
    Sec. 2.2): the share of a run's tokens that counts at batch B. In (0, 1]; -> 1 as B -> 0,
    -> B_crit / B as B -> inf.

    Args: batch_tokens (tokens per optimizer step, > 0), b_crit_tokens (tokens, > 0); arrays
    broadcast (unchecked there).
    Raises: TrainplanError on a non-positive scalar.
    """
    if isinstance(batch_tokens, int | float) and isinstance(b_crit_tokens, int | float):
        b = check_positive("batch_tokens", batch_tokens)
        c = check_positive("b_crit_tokens", b_crit_tokens)
        return 1.0 / (1.0 + b / c)
    return 1.0 / (1.0 + np.asarray(batch_tokens, dtype=float) / np.asarray(b_crit_tokens, dtype=float))


def min_steps(steps: float, batch_tokens: float, b_crit_tokens: float) -> float:
    """S_min = S / (1 + B_crit / B) (Kaplan et al. 2020 Sec. 5.1): the steps an infinitely large
    batch would need for the loss `steps` steps at `batch_tokens` reach.

    Raises: TrainplanError on a non-positive input."""
    s = check_positive("steps", steps)
    b = check_positive("batch_tokens", batch_tokens)
    c = check_positive("b_crit_tokens", b_crit_tokens)
    return s / (1.0 + c / b)
