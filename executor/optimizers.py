"""The optimizer a plan's `optimizer_bits` and `precision` stand for, from maintained libraries.

| bits | library | states | memory model |
|---|---|---|---|
| 32 | torch `AdamW(fused=True)` (fp32 or bf16-mixed parameters) | fp32 |
`trainplan.costmodels.step.memory.adam_state_bytes` |
| 16 | torch `AdamW(fused=True)` over pure-bf16 parameters | bf16 (the parameter dtype) | same |
| 8 | bitsandbytes `AdamW8bit` (Dettmers et al. 2022) | block-wise uint8, 256/block | same |
| 4 | torchao `AdamW4bit` (Li et al. 2023) | block-wise 4-bit, 128/block | same |

torchao's optimizers compile their per-parameter update with `torch.compile(fullgraph=True)`,
which refuses to run under a `TorchDispatchMode` (MemTracker, FlopCounterMode) and on CPU needs
a C++ toolchain and one compile per tensor shape (~5-20 s each): on CPU, and in a measured step
anywhere, the update runs eagerly (`AdamW4bit.step`), the same ops without fusion.

bitsandbytes and torchao are imported when their width is asked for: together they take seconds
to load and warn about kernels they cannot find, which 32- and 16-bit runs do not need. Both
come with `pip install 'trainplan[run]'`; without them an 8- or 4-bit plan raises
`MissingExtraError` naming that extra.
"""

from __future__ import annotations

from unittest import mock

import torch

from trainplan.costmodels.step.precision import check_optimizer_bits as check_widths
from trainplan.errors import require_extra
from trainplan.modeling.torch_private import get_current_dispatch_mode

BETAS = (0.9, 0.95)
"""AdamW's (beta1, beta2) for every width."""
WEIGHT_DECAY = 0.1
"""AdamW's decoupled weight decay for every width."""


def check_optimizer_bits(bits, precision: str) -> int:
    """`bits` as an int, if the executor can run it at `precision`.

    Raises:
        TrainplanError: names the value and the valid ones (`trainplan.costmodels.step.precision.check_optimizer_bits`).
    """
    check_widths((bits,), precision)
    return int(bits)


def _dispatch_mode_active() -> bool:
    return get_current_dispatch_mode() is not None


def _torchao_adamw4bit():
    require_extra("torchao.optim", "run", "4-bit AdamW (optimizer_bits=4)")  # MissingExtraError without it
    from torchao.optim import AdamW4bit as _Base

    class AdamW4bit(_Base):
        """torchao's AdamW4bit; eager (not compiled) on CPU and under a measuring dispatch mode."""

        def step(self, closure=None):
            on_cpu = all(p.device.type == "cpu" for g in self.param_groups for p in g["params"])
            if not (on_cpu or _dispatch_mode_active()):
                return super().step(closure)
            with mock.patch.object(torch, "compile", lambda fn, **_: fn):
                return super().step(closure)
    return AdamW4bit


def build_optimizer(params, bits: int, lr: float, precision: str = "fp32") -> torch.optim.Optimizer:
    """AdamW (betas 0.9/0.95, weight decay 0.1) with `bits`-wide states (table above).

    Raises:
        TrainplanError: `bits` cannot run at `precision` (`check_optimizer_bits`).
        MissingExtraError: 8 or 4 bits without bitsandbytes or torchao (`trainplan[run]`).
    """
    bits = check_optimizer_bits(bits, precision)
    if bits in (32, 16):
        # fused on every device (`trainplan.costmodels.step.model.ADAMW_IMPLEMENTATION`: what the memory
        # model prices)
        return torch.optim.AdamW(params, lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY, fused=True)
    if bits == 8:
        bnb = require_extra("bitsandbytes", "run", "8-bit AdamW (optimizer_bits=8)")
        return bnb.optim.AdamW8bit(params, lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
    # torchao keeps the learning rate as a tensor (`set_lr` updates it in place)
    return _torchao_adamw4bit()(params, lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's learning rate; in place where the optimizer keeps it as a tensor
    (torchao raises if it is replaced by a float)."""
    for group in opt.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
