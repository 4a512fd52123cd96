"""Training precisions and the optimizer-state widths the executor runs at each: the bytes per
parameter the memory model charges, and the checks of a plan's `optimizer_bits`."""

from __future__ import annotations

from trainplan.errors import TrainplanError

PRECISIONS = {
    # name: (weight bytes, grad bytes, master bytes, compute dtype for the profile's peak)
    "fp32": (4, 4, 0, "fp32"),
    # torch.autocast: fp32 parameters and gradients, bf16 matmuls (16 bytes/param with Adam,
    # as ZeRO's 2 + 2 + 12 split, Rajbhandari et al. 2020 Sec. 3.1, with other categories)
    "bf16-mixed": (4, 4, 0, "bf16"),
    "bf16": (2, 2, 0, "bf16"),
}



def optimizer_bits_for(precision: str) -> tuple[int, ...]:
    """Adam-state widths the executor runs with parameters of `precision`
    (`trainplan.executor.optimizers`): torch's AdamW keeps states in the parameter dtype, so 32 bits
    needs fp32 parameters (fp32, bf16-mixed) and 16 bits pure-bf16 ones; 8 (bitsandbytes) and 4
    (torchao) run with either."""
    return (16, 8, 4) if precision == "bf16" else (32, 8, 4)


def check_optimizer_bits(optimizer_bits, precision: str) -> None:
    """Raises TrainplanError naming the first width in `optimizer_bits` the executor cannot run
    at `precision` (`optimizer_bits_for`), or an empty list."""
    valid = optimizer_bits_for(precision)
    if isinstance(optimizer_bits, int) or not hasattr(optimizer_bits, "__iter__") or not tuple(optimizer_bits):
        raise TrainplanError(f"optimizer_bits={optimizer_bits!r} must be a non-empty list of widths from "
                             f"{', '.join(map(str, valid))}")
    for b in optimizer_bits:
        if isinstance(b, bool) or b not in (32, 16, 8, 4):
            raise TrainplanError(f"optimizer_bits={b!r} is not a width: use 32, 16, 8 or 4 (at "
                                 f"precision {precision!r}: {', '.join(map(str, valid))})")
        if b not in valid:
            raise TrainplanError(f"optimizer_bits={b!r} cannot run with precision={precision!r}: use "
                                 f"{', '.join(map(str, valid))} (torch AdamW keeps states in the "
                                 "parameter dtype: 32 needs fp32 parameters, 16 pure bf16)")
