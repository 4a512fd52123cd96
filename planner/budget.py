"""`Budget`: how much compute a plan may spend, on how many devices; and the checks of the other
numbers a solve takes (time limit, corpus size, devices the corpus can feed, the global batch),
and the corpus size assumed when none is given (`UNLIMITED_DATA_TOKENS`).

Every check raises a `BudgetError` (a `TrainplanError`) whose message names the value and what
would be valid; the CLI prints it on one line and exits with status 2.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from trainplan.errors import BudgetError, DataError

MAX_WALL_CLOCK_S = 1e9
"""Largest wall clock a plan may run: 1e9 s, about 31.7 years. The solver counts time in
microseconds in 64-bit integers; far above this its constraints overflow."""
MAX_FLOPS = 1e30
"""Largest FLOP budget: about 26,000 times Llama 3.1 405B's 3.8e25 training FLOPs."""
MAX_DEVICES = 1_000_000
"""Most devices a budget may name: about ten times the largest training clusters reported
(the memory model partitions states over every device)."""
MAX_GLOBAL_BATCH_TOKENS = 2**40
"""Largest global batch, tokens per optimizer step: about 1.1e12, over 250,000 times the 4M
tokens of the largest published pre-training batches (Llama 3 405B: 16M tokens, Meta, "The
Llama 3 Herd of Models", 2024, Sec. 3.4.1), yet far inside the solver's 64-bit integers."""
MAX_TIME_LIMIT_S = 86400.0
"""Largest solver time limit, s (a day)."""
UNLIMITED_DATA_TOKENS = 15 * 10**12
"""Default unique tokens when no corpus size is given: Llama 3's 15T pre-training tokens
(Meta, "The Llama 3 Herd of Models", 2024), i.e. no repetition for any plan here."""


def _years(seconds: float) -> str:
    return f"about {seconds / (365.25 * 86400):.3g} years"


@dataclass(frozen=True, kw_only=True, slots=True)
class Budget:
    """Compute budget: exactly one of device-hours, wall-clock seconds or FLOPs, and a device
    count.

    Limits: wall clock at most `MAX_WALL_CLOCK_S` (device-hours likewise: at most that many
    seconds per device), FLOPs at most `MAX_FLOPS`, devices at most `MAX_DEVICES`.

    Raises:
        BudgetError: none or several limits given, a limit that is not a positive finite
            number or is above its maximum, or devices not in [1, MAX_DEVICES].
    """

    devices: int = 1
    """Devices the run may use."""
    device_hours: float | None = None
    """Device-hours (devices x wall-clock hours)."""
    wall_clock_s: float | None = None
    """Wall-clock seconds of training."""
    flops: float | None = None
    """FLOPs executed over all devices, recompute included."""

    def __post_init__(self) -> None:
        if not isinstance(self.devices, int) or isinstance(self.devices, bool) or self.devices < 1:
            raise BudgetError(f"devices={self.devices!r} must be a whole number >= 1")
        if self.devices > MAX_DEVICES:
            raise BudgetError(f"devices={self.devices} must be a whole number from 1 to {MAX_DEVICES:,}")
        given = {k: v for k, v in (("device_hours", self.device_hours),
                                   ("wall_clock_s", self.wall_clock_s), ("flops", self.flops))
                 if v is not None}
        if len(given) != 1:
            raise BudgetError(
                "give exactly one budget limit: device_hours, wall_clock_s or flops "
                f"(got {', '.join(given) or 'none'})")
        (name, value), = given.items()
        if (not isinstance(value, (int, float)) or isinstance(value, bool)
                or not math.isfinite(value) or value <= 0):
            raise BudgetError(f"budget {name}={value!r} must be a positive finite number")
        if name == "wall_clock_s" and value > MAX_WALL_CLOCK_S:
            raise BudgetError(
                f"budget wall_clock_s={value:g} must be a positive finite number at most "
                f"{MAX_WALL_CLOCK_S:g} s ({_years(MAX_WALL_CLOCK_S)})")
        if name == "device_hours" and value * 3600.0 / self.devices > MAX_WALL_CLOCK_S:
            most = MAX_WALL_CLOCK_S * self.devices / 3600.0
            raise BudgetError(
                f"budget device_hours={value:g} must be a positive finite number at most "
                f"{most:.4g} on {self.devices} device(s) ({MAX_WALL_CLOCK_S:g} s of wall clock, "
                f"{_years(MAX_WALL_CLOCK_S)})")
        if name == "flops" and value > MAX_FLOPS:
            raise BudgetError(f"budget flops={value:g} must be a positive finite number at most "
                              f"{MAX_FLOPS:g} FLOPs")

    @property
    def kind(self) -> str:
        return "device_hours" if self.device_hours is not None else (
            "wall_clock_s" if self.wall_clock_s is not None else "flops")

    def wall_s_for(self, devices_used: int) -> float | None:
        """Wall-clock seconds available when `devices_used` devices run (None for a FLOP
        budget)."""
        if self.device_hours is not None:
            return self.device_hours * 3600.0 / devices_used
        return self.wall_clock_s

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def check_time_limit(time_limit_s) -> float:
    """The solver time limit as a float.

    Raises:
        BudgetError: not a positive finite number of seconds at most `MAX_TIME_LIMIT_S`.
    """
    if (not isinstance(time_limit_s, (int, float)) or isinstance(time_limit_s, bool)
            or not math.isfinite(time_limit_s) or not 0 < time_limit_s <= MAX_TIME_LIMIT_S):
        raise BudgetError(f"time limit {time_limit_s!r} s must be a positive finite number of "
                          f"seconds at most {MAX_TIME_LIMIT_S:g} (e.g. 10)")
    return float(time_limit_s)


def check_seed(seed) -> int:
    """The solver seed.

    Raises:
        BudgetError: not a whole number in [0, 2**31 - 1] (CP-SAT's random seed).
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**31:
        raise BudgetError(f"seed={seed!r} must be a whole number from 0 to {2**31 - 1}")
    return seed


def check_global_batch_tokens(global_batch_tokens) -> int | None:
    """The global batch, tokens per optimizer step over all ranks (None: no global batch, each
    optimizer step one micro-step).

    Raises:
        BudgetError: not a whole number of tokens from 1 to `MAX_GLOBAL_BATCH_TOKENS`.
    """
    n = global_batch_tokens
    if n is None:
        return None
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_GLOBAL_BATCH_TOKENS:
        raise BudgetError(f"global_batch_tokens={n!r} must be a whole number of tokens per optimizer "
                          f"step from 1 to {MAX_GLOBAL_BATCH_TOKENS:,} (e.g. 4194304 for a 4M-token "
                          "batch), or None for one micro-step per step")
    return n


def check_data_tokens(data_tokens, seq_len: int) -> None:
    """Check a corpus size given to the planner (None: unconstrained).

    Raises:
        DataError: not a whole number >= 1, or fewer tokens than one sequence needs
            (seq_len + 1: inputs and the shifted labels).
    """
    if data_tokens is None:
        return
    if not isinstance(data_tokens, int) or isinstance(data_tokens, bool) or data_tokens < 1:
        raise DataError(f"data_tokens={data_tokens!r} must be a whole number of tokens >= 1 "
                        "(the corpus size; leave it out for an unconstrained corpus)")
    if data_tokens < seq_len + 1:
        raise DataError(f"corpus has {data_tokens} tokens, fewer than one sequence needs "
                        f"(seq_len + 1 = {seq_len + 1}); use a larger corpus or seq_len <= "
                        f"{data_tokens - 1}")


def check_devices_usable(devices: int, seq_len: int, sp_degrees, data_tokens: int | None) -> None:
    """Check that a corpus of `data_tokens` can feed `devices` devices: every data-parallel rank
    reads at least one sequence per step, so one step reads at least
    `devices / max(sp_degrees) * seq_len` tokens, which must not exceed the corpus.

    Raises:
        BudgetError: more devices than any plan can use on this corpus; the message names the
            most that can be used.
    """
    if data_tokens is None or not sp_degrees:
        return
    sp = max(sp_degrees)
    ranks = devices // sp
    if ranks * seq_len <= data_tokens:
        return
    most_ranks = max(1, data_tokens // seq_len)
    raise BudgetError(
        f"devices={devices} is more than any plan can use: with sp_degree at most {sp} that is "
        f"{ranks:,} data-parallel ranks, which read at least {ranks * seq_len:,} tokens per step "
        f"(one sequence of {seq_len} each) but the corpus has {data_tokens:,}; use at most "
        f"{most_ranks * sp:,} devices, or a larger corpus")
