"""Repeated data and excess parameters in the loss law: Muennighoff et al. 2023's effective data
and parameters (`trainplan.costmodels.loss.law.LossLaw.predict` applies the first).

Source: Muennighoff et al. 2023, "Scaling Data-Constrained Language Models" (NeurIPS;
arXiv:2305.16264), Sec. 3: effective data D' = U_D + U_D R_D* (1 - exp(-R_D / R_D*)) (eq. 5) and the
analogous N' (eq. 6); fitted R_D* = 15.387756, R_N* = 5.309743.
"""

from __future__ import annotations

import numpy as np

from trainplan.costmodels.checks import check_non_negative, check_positive

#: Muennighoff et al. 2023, Sec. 3 (fit reported as R_D* = 15.387756): repetitions of the data
#: after which a repeated token is worth 1/e of a fresh one.
R_D_STAR = 15.4
#: Muennighoff et al. 2023, Sec. 3 (fit reported as R_N* = 5.309743): the same decay constant for
#: parameters in excess of the compute-optimal size for the unique data.
R_N_STAR = 5.3


def effective_array(tokens_seen: np.ndarray, unique_tokens: float | np.ndarray, r_star: float) -> np.ndarray:
    """Muennighoff et al. 2023 eq. 5 on arrays, without input checks (`effective_tokens` is the
    checked scalar form; `effective_params` applies the same decay to parameters, eq. 6).

    Args: tokens_seen (tokens, >= 0), unique_tokens (tokens, > 0; a scalar or an array that
    broadcasts with `tokens_seen`), r_star (repetitions, > 0).
    Returns: effective tokens, the broadcast shape: `tokens_seen` itself where it is at most
    `unique_tokens` (one epoch or less).
    """
    repeats = np.maximum(tokens_seen / unique_tokens - 1.0, 0.0)
    eff = unique_tokens + unique_tokens * r_star * -np.expm1(-repeats / r_star)
    return np.where(tokens_seen <= unique_tokens, tokens_seen, eff)


def effective_tokens(tokens_seen: float, unique_tokens: float, r_star: float = R_D_STAR) -> float:
    """Tokens of fresh data that `tokens_seen` tokens drawn from `unique_tokens` are worth.

    Muennighoff et al. 2023, eq. 5: with U_D = unique tokens and R_D = tokens_seen / U_D - 1
    repetitions, D' = U_D + U_D * R_D* * (1 - exp(-R_D / R_D*)). R_D* = 15.4 (their fit,
    15.387756). Limits: one epoch or less gives D' = tokens_seen; infinitely many epochs give
    D' -> U_D * (1 + R_D*). D' is increasing in tokens_seen (derivative exp(-R_D / R_D*) > 0).

    Args: tokens_seen (tokens, >= 0), unique_tokens (tokens, > 0), r_star (repetitions, > 0).
    Returns: effective tokens.
    Raises: TrainplanError on a negative, zero (unique_tokens, r_star) or non-finite input.
    """
    seen = check_non_negative("tokens_seen", tokens_seen)
    unique = check_positive("unique_tokens", unique_tokens)
    r = check_positive("r_star", r_star)
    return float(effective_array(np.asarray(seen), unique, r))


def effective_params(n_params: float, optimal_params: float, r_star: float = R_N_STAR) -> float:
    """Parameters that `n_params` are worth when the compute-optimal size for the unique data is
    `optimal_params` (U_N): excess parameters decay like repeated data.

    Muennighoff et al. 2023, eq. 6: R_N = n_params / U_N - 1, N' = U_N + U_N R_N* (1 -
    exp(-R_N / R_N*)), R_N* = 5.3 (their fit, 5.309743). At or below U_N, N' = n_params.
    Not applied by `LossLaw.predict` (which would need U_N from the law's compute-optimal
    frontier); exposed for the planner's data-constrained mode.

    Args: n_params (parameters, >= 0), optimal_params (parameters, > 0), r_star (> 0).
    Returns: effective parameters.
    Raises: TrainplanError on a bad input.
    """
    n = check_non_negative("n_params", n_params)
    u = check_positive("optimal_params", optimal_params)
    r = check_positive("r_star", r_star)
    return float(effective_array(np.asarray(n), u, r))
