"""Trace sizes: the (micro-batch, sequence) primes a model is traced at, chosen so that every
traced size factors into its batch, sequence and model parts (`trainplan.planner.capture.trace._symbolize`)
and the trace takes the branches a run at the plan's sequence takes (a sliding window's mask)."""

from __future__ import annotations

import sympy
from torch import nn

from trainplan.errors import CaptureError
from trainplan.planner.capture.layout import config_int, module_int

SENTINELS = [(7, 113), (11, 127), (13, 131), (5, 139), (17, 151), (19, 157), (23, 163), (29, 167)]
"""(micro-batch, sequence) primes to trace at, in order of preference (`pick_sentinels`)."""


def model_dims(model: nn.Module) -> set[int]:
    """Every parameter and buffer dimension and integer config field of `model`: sizes the
    sentinel primes must not divide."""
    dims = {int(d) for t in [*model.parameters(), *model.buffers()] for d in t.shape}
    cfg = getattr(model, "config", None)
    if cfg is not None:
        dims |= {int(v) for v in vars(cfg).values() if isinstance(v, int) and not isinstance(v, bool)}
    return {d for d in dims if d > 1}


def window_of(model: nn.Module) -> int | None:
    """The narrowest sliding window of the model's attention (its modules' `sliding_window`, else
    its config's unless `use_sliding_window` is off), or None."""
    mods = [vars(m)["sliding_window"] for m in model.modules() if "sliding_window" in vars(m)]
    cfg = getattr(model, "config", None)
    cands = mods or ([getattr(cfg, "sliding_window", None)] if getattr(cfg, "use_sliding_window", True) is not False
                     else [])
    ints = [w for w in cands if isinstance(w, int) and not isinstance(w, bool) and w > 0]
    return min(ints) if ints else None


def pick_sentinels(model: nn.Module, seq_len: int | None = None) -> tuple[int, int]:
    """(micro-batch, sequence) to trace at: two primes that divide no model dimension, so every
    traced size factors into its batch, sequence and model parts (`trainplan.planner.capture.trace._symbolize`).

    The sequence prime sits on the side of the model's sliding window that `seq_len` (the plan's,
    when known) is on, so the trace builds a window mask exactly when the run does (transformers
    makes one only for a sequence longer than the window), and, where the model has a hard limit
    below the default (`max_position_embeddings`, `n_positions`, `max_seq_len`, `block_size`
    under 113), at or under it.

    Raises:
        CaptureError: no such pair of primes."""
    dims = model_dims(model)
    window = window_of(model)
    lo, hi = 2, None
    if window is not None:
        if seq_len is not None and seq_len > window:
            lo = window + 1
        else:
            hi = window - 1
    limit = config_int(model, "max_position_embeddings", "n_positions", "max_seq_len", "block_size") \
        or module_int(model, "block_size", "max_seq_len")
    if limit is not None and limit < SENTINELS[0][1] and limit >= lo:
        hi = min(hi or limit, limit)
    seqs = [s0 for _, s0 in SENTINELS if s0 >= lo and (hi is None or s0 <= hi)]
    if hi is not None:  # below a window or a limit: the largest primes there
        seqs += [p for p in sorted(sympy.primerange(max(lo, 11), hi + 1), reverse=True)[:20] if p not in seqs]
    else:  # above a window: the smallest primes past it
        p = lo - 1
        while len(seqs) < len(SENTINELS):
            p = int(sympy.nextprime(p))
            seqs.append(p)
    for s0 in seqs:
        for b0, _ in SENTINELS:
            if b0 != s0 and not any(d % b0 == 0 or d % s0 == 0 for d in dims):
                return b0, s0
    raise CaptureError(f"{type(model).__name__}: every capture sentinel prime pair ({SENTINELS}) divides one of "
                       "the model's dimensions")
