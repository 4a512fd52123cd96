"""Optimizer states and the optimizer step as the executor runs them (`trainplan.executor.optimizers`):
bytes of Adam's moments at each state width, the scratch torch's AdamW allocates during its
step, and the bytes one step moves (its roofline time, `optimizer_step_s`)."""

from __future__ import annotations

from trainplan.errors import TrainplanError

ADAMW_IMPLEMENTATION = "fused"
"""The torch AdamW implementation `trainplan.executor.optimizers.build_optimizer` runs for 32- and 16-bit
states on every device (CPU, CUDA, ROCm): `fused=True`, the fastest on each (on one CPU thread 3x
the per-tensor loop's speed over a tiny Llama's tensors, measured) and without step temporaries
(`adamw_step_temp_bytes`)."""

# Bytes per parameter of Adam's two moments at each optimizer-state width, as the libraries
# `trainplan.executor.optimizers` runs hold them. 8 bits: bitsandbytes `AdamW8bit`, block-wise uint8 codes
# with one fp32 absmax per 256-element block (Dettmers et al. 2022, Sec. 2.1; `blocksize=256` in
# bitsandbytes >= 0.43), tensors under `min_8bit_size` = 4096 elements kept in fp32, the step
# count a Python int. 4 bits: torchao `AdamW4bit` (Li et al. 2023), 4-bit codes packed two per
# byte with one fp32 scale per 128-element block and a 16-entry fp32 code map per state
# (`torchao/optim/subclass_4bit.py`, `OptimState4bit.zeros`); tensors under 4096 elements or not
# a multiple of the block stay in the parameter dtype (`_AdamBase._new_buffer`).
OPT_BLOCK = {8: 256, 4: 128}
MIN_QUANT_NUMEL = 4096
TORCHAO_QMAP_BYTES = 16 * 4
"""One 4-bit state's code map: 2**4 fp32 entries (torchao keeps one per state tensor)."""
STEP_TENSOR_BYTES = 4
"""torch `AdamW`'s and torchao's per-parameter `step`: a 0-d fp32 tensor."""
TORCHAO_EAGER_STEP_COPIES = 6
"""fp32 copies of the largest tensor alive at once in torchao's `single_param_adam` run
eagerly over fp32 parameters (the weight-decayed parameter, dequantized and updated moments,
the squared gradient, the denominator), one more over bf16 ones (`p.float()` copies): counted
from its code and measured with MemTracker (tests/unit/costmodels/test_bits.py).
The executor runs it eagerly only under a measuring dispatch mode; compiled, Inductor fuses
the update and holds fewer, so this is an upper bound there."""


def _check_bits(optimizer_bits) -> None:
    if optimizer_bits not in (32, 16, 8, 4):
        raise TrainplanError(f"optimizer_bits={optimizer_bits} is not supported: use 32, 16, 8 or 4")


def adam_state_bytes(numel: int, optimizer_bits: int, param_bytes: int = 4) -> float:
    """Bytes of Adam's exp_avg and exp_avg_sq (and its step tensor) for one parameter tensor of
    `numel` elements whose parameters are `param_bytes` wide, as the executor's library for
    these bits holds them (32 and 16: torch AdamW, states in the parameter dtype; 8:
    bitsandbytes; 4: torchao; see the module constants for the layouts).

    Raises:
        TrainplanError: `optimizer_bits` not in 32, 16, 8, 4.
    """
    _check_bits(optimizer_bits)
    if optimizer_bits == 32:
        return 2 * numel * 4 + STEP_TENSOR_BYTES
    if optimizer_bits == 16:
        return 2 * numel * 2 + STEP_TENSOR_BYTES
    if optimizer_bits == 8:
        if numel < MIN_QUANT_NUMEL:
            return 2 * numel * 4
        # two states, each: codes + one fp32 absmax per block (the code maps, `qmap1`/`qmap2`,
        # are one pair shared by the whole optimizer: `quantization_map_bytes`)
        return 2 * (numel + 4 * -(-numel // OPT_BLOCK[8]))
    block = OPT_BLOCK[4]
    if numel < MIN_QUANT_NUMEL or numel % block:
        return 2 * numel * param_bytes + STEP_TENSOR_BYTES
    return 2 * (numel // 2 + 4 * (numel // block) + TORCHAO_QMAP_BYTES) + STEP_TENSOR_BYTES


def quantization_map_bytes(optimizer_bits: int) -> float:
    """Bytes of the block-wise optimizer's code maps shared by all tensors of one optimizer:
    bitsandbytes' two fp32 maps of 256 entries (`Optimizer8bit.fill_qmap`); 0 otherwise (torchao
    keeps one per state, counted in `adam_state_bytes`)."""
    return 2 * 4 * 2**8 if optimizer_bits == 8 else 0.0


ADAMW_IMPLEMENTATIONS = ("fused", "foreach", "single_tensor")
"""torch `AdamW`'s implementations (`fused=True`, `foreach=True`, neither)."""


def adamw_step_temp_bytes(adamw: str, *, state_bytes: int, largest_numel: float, local_numel: float) -> float:
    """Bytes torch's AdamW allocates during its step beyond the states (torch 2.13
    `torch/optim/adamw.py` / `adam.py`), for states `state_bytes` wide:

    - `fused` (`_fused_adamw`): one kernel per tensor list updates parameters and states in
      place: 0 (measured with MemTracker, tests/unit/costmodels/test_optimizer_memory.py).
    - `foreach` (`_multi_tensor_adam`): `torch._foreach_sqrt(exp_avg_sqs)` makes one tensor per
      state, then updates them in place: `local_numel` x `state_bytes`.
    - `single_tensor` (`_single_tensor_adam`): `(exp_avg_sq.sqrt() / bias_correction2_sqrt)`
      holds the square root and its quotient at once for the tensor being updated:
      2 x `largest_numel` x `state_bytes`.

    Raises:
        TrainplanError: unknown implementation."""
    if adamw == "fused":
        return 0.0
    if adamw == "foreach":
        return local_numel * state_bytes
    if adamw == "single_tensor":
        return 2.0 * largest_numel * state_bytes
    raise TrainplanError(f"adamw={adamw!r}; valid: {', '.join(ADAMW_IMPLEMENTATIONS)}")


def adamw_traffic(local_numel: float, n_tensors: int, optimizer_bits: int,
                  adamw: str = ADAMW_IMPLEMENTATION) -> tuple[float, int]:
    """(bytes moved, ops) of one AdamW step over `local_numel` parameters in `n_tensors` tensors.

    32/16-bit, torch AdamW in the parameter dtype (fp32 or bf16): `fused` reads parameter,
    gradient and both moments and writes parameter and moments, 7 passes, in one kernel
    dispatch per dtype group (`torch._fused_adamw_`); `foreach` and `single_tensor` add the
    square root and its quotient written and read (11 passes), ~12 ops per tensor.
    8/4-bit (bitsandbytes, torchao compiled): one fused kernel per tensor reading parameter and
    gradient (fp32) and reading and writing the quantized moments.

    Raises:
        TrainplanError: unknown bits or implementation."""
    _check_bits(optimizer_bits)
    if optimizer_bits in (32, 16):
        width = optimizer_bits / 8
        if adamw == "fused":
            return 7 * width * local_numel, 1
        if adamw in ADAMW_IMPLEMENTATIONS:
            return 11 * width * local_numel, 12 * n_tensors
        raise TrainplanError(f"adamw={adamw!r}; valid: {', '.join(ADAMW_IMPLEMENTATIONS)}")
    q = optimizer_bits / 8
    return (3 * 4 + 4 * q) * local_numel, 2 * n_tensors


def optimizer_step_s(hw, optimizer_bits: int, local_numel: float, traffic_bytes: float) -> float:
    """Seconds of one optimizer step on a device of profile `hw` holding `local_numel` parameters'
    states: the profile's measured seconds per parameter for these bits
    (`HardwareProfile.optimizer_s_per_param`, the cpu profile's probe), else the roofline of its
    traffic (`adamw_traffic`) at the profile's memory bandwidth."""
    measured = hw.optimizer_s_per_param.get(str(optimizer_bits))
    if measured is not None:
        return measured * local_numel
    return traffic_bytes / (hw.hbm_bandwidth_bytes_per_s * hw.memory_efficiency)
