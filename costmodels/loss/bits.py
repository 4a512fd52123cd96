"""Loss penalties of lower-precision training state: optimizer states, saved activations,
weights and pure-bf16 parameters, as additive nats per token on the loss law's prediction.

Defaults are published "no measurable degradation" results read conservatively (the fields
cite each); `trainplan calibrate` refits them by non-negative least squares from the measured
held-out loss deltas of runs that differ only in their bits (`trainplan.executor.calibrate.bits`) and
stores them with the local loss law (`LossLaw.bits`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from trainplan.costmodels.checks import check_non_negative
from trainplan.errors import TrainplanError


@dataclass(frozen=True, kw_only=True, slots=True)
class BitsPenalty:
    """Additive loss penalties (nats/token) for lower-precision training state, relative to
    bf16 mixed precision with fp32 optimizer states. Defaults are conservative readings of
    published "no measurable degradation" results, not measured deltas; calibration refits them.
    """

    optimizer_16bit_nats: float = 0.001
    """bf16 Adam moments with fp32 master weights. No source gives a delta; set to half the
    8-bit value as an assumption."""
    optimizer_8bit_nats: float = 0.002
    """Block-wise 8-bit Adam. Dettmers et al. 2022, "8-bit Optimizers via Block-wise
    Quantization" (ICLR; arXiv:2110.02861), Table 1: matches 32-bit Adam on language modelling
    within seed noise. 0.002 nats (~0.2% perplexity) is a tie-breaker, not a measurement."""
    optimizer_4bit_nats: float = 0.01
    """4-bit Adam states. Li, Chen & Zhu 2023, "Memory Efficient Optimizers with 4-bit States"
    (NeurIPS; arXiv:2309.01507): comparable accuracy on fine-tuning and Transformer pretraining
    (WMT14), no LLM pretraining reported; 0.01 nats is a placeholder."""
    activation_16bit_nats: float = 0.0
    """16-bit saved activations: bf16 storage of what was computed (a no-op for tensors mixed
    precision already computes in bf16). Mixed precision keeps activations in 16 bits at fp32
    accuracy (Micikevicius et al. 2018, "Mixed Precision Training", ICLR; arXiv:1710.03740,
    Sec. 4): no penalty by default. A component of its own so that calibration does not take a
    bf16-compressed run for a full-width one (`trainplan.executor.calibrate.bits`)."""
    activation_8bit_nats: float = 0.005
    """8-bit saved activations (int8, per-channel scale). ActNN (Chen et al. 2021, ICML; arXiv:2104.14129) compresses
    saved activations to 2 bits with negligible accuracy loss (vision models); Jetfire (Xi et al.
    2024, ICML; arXiv:2403.12422) pretrains GPT-2 with INT8 data flow at comparable loss.
    0.005 nats is a placeholder."""
    weight_16bit_nats: float = 0.0
    """bf16/fp16 weights with fp32 master copy: Micikevicius et al. 2018, "Mixed Precision
    Training" (ICLR; arXiv:1710.03740), Sec. 4: matches fp32 accuracy. The baseline."""
    pure_bf16_nats: float = 0.01
    """Pure bf16 training (bf16 weights updated in bf16, no fp32 master copy, round to nearest):
    Zamirai et al. 2020, "Revisiting BFloat16 Training" (arXiv:2010.06192), Sec. 3: nearest
    rounding of the weight update loses small updates and degrades quality (BERT, ResNet);
    stochastic rounding or Kahan summation recovers it. 0.01 nats is a placeholder."""

    OPTIMIZER_BITS: ClassVar[tuple[int, ...]] = (32, 16, 8, 4)
    ACTIVATION_BITS: ClassVar[tuple[int, ...]] = (32, 16, 8)
    WEIGHT_BITS: ClassVar[tuple[int, ...]] = (32, 16)
    PRECISIONS: ClassVar[tuple[str, ...]] = ("fp32", "bf16-mixed", "bf16")

    def __post_init__(self) -> None:
        for f in fields(self):
            check_non_negative(f"BitsPenalty.{f.name}", getattr(self, f.name))

    def penalty(self, optimizer_bits: int, activation_bits: int = 32, weight_bits: int = 16,
                precision: str = "fp32") -> float:
        """Sum of the per-state penalties, nats per token; see `bits_loss_penalty`."""
        if precision not in self.PRECISIONS:
            raise TrainplanError(f"precision={precision!r} is not known; valid: {list(self.PRECISIONS)}")
        for name, bits, valid in (
            ("optimizer_bits", optimizer_bits, self.OPTIMIZER_BITS),
            ("activation_bits", activation_bits, self.ACTIVATION_BITS),
            ("weight_bits", weight_bits, self.WEIGHT_BITS),
        ):
            if isinstance(bits, bool) or bits not in valid:
                raise TrainplanError(f"{name}={bits!r} is not supported; valid: {list(valid)}")
        opt = {32: 0.0, 16: self.optimizer_16bit_nats, 8: self.optimizer_8bit_nats,
               4: self.optimizer_4bit_nats}[int(optimizer_bits)]
        act = {8: self.activation_8bit_nats, 16: self.activation_16bit_nats}.get(int(activation_bits), 0.0)
        wgt = self.weight_16bit_nats if int(weight_bits) == 16 else 0.0
        return opt + act + wgt + (self.pure_bf16_nats if precision == "bf16" else 0.0)


DEFAULT_BITS_PENALTY = BitsPenalty()


def bits_loss_penalty(
    optimizer_bits: int,
    activation_bits: int = 32,
    weight_bits: int = 16,
    *,
    precision: str = "fp32",
    penalty: BitsPenalty | None = None,
) -> float:
    """Expected additive loss penalty, nats per token, of storing optimizer states, saved
    activations and weights at the given bit widths.

    Penalties add (a first-order assumption: the effects are small and independent). Sources and
    values are on the `BitsPenalty` fields (Dettmers et al. 2022; Li et al. 2023; Chen et al.
    2021; Xi et al. 2024; Micikevicius et al. 2018).

    Args: optimizer_bits in (32, 16, 8, 4); activation_bits in (32, 16, 8) (saved activations:
        32 as computed); weight_bits in (32, 16); precision `fp32`, `bf16-mixed` or `bf16`
        (pure bf16 adds `pure_bf16_nats`); penalty: the values to use (default
        `DEFAULT_BITS_PENALTY`).
    Returns: nats per token, >= 0.
    Raises: TrainplanError on an unsupported bit width or precision, listing the valid ones.
    """
    return (penalty or DEFAULT_BITS_PENALTY).penalty(optimizer_bits, activation_bits, weight_bits, precision)


COMPONENTS = ("optimizer_16bit_nats", "optimizer_8bit_nats", "optimizer_4bit_nats",
              "activation_16bit_nats", "activation_8bit_nats", "pure_bf16_nats")
"""The penalty fields a setting can switch on (`components`), in `BitsPenalty` order."""


def components(optimizer_bits: int, activation_bits: int = 32, precision: str = "fp32") -> dict[str, int]:
    """Which `COMPONENTS` a setting's penalty sums (1) and which it does not (0): the design
    row of the calibration's least squares. Raises TrainplanError as `bits_loss_penalty`."""
    DEFAULT_BITS_PENALTY.penalty(optimizer_bits, activation_bits, 16, precision)  # validates
    on = {f"optimizer_{optimizer_bits}bit_nats", "pure_bf16_nats" if precision == "bf16" else "",
          f"activation_{activation_bits}bit_nats" if activation_bits in (16, 8) else ""}
    return {c: int(c in on) for c in COMPONENTS}
