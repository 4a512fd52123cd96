"""Device kernel time of a training step by kind (matmul, communication, other), measured with
`torch.profiler` on an accelerator; `trainplan.executor.measure.measured_step` profiles `PROFILED_STEPS`
and keeps the mean per step in `RunRecord.kernel_time_s`, which `trainplan calibrate` refits a
GPU profile from (`trainplan.executor.calibrate.gpu`).

The profiler records every kernel, copy and memset the device ran (Kineto: CUPTI on CUDA,
roctracer on ROCm, which torch also calls "cuda"), with start and end times. Each is sorted by
its name (`kernel_kind`):

- `matmul`: GEMMs (cuBLAS/cuBLASLt `*gemm*`, `nvjet_*` and `sm90_xmma_*` on Hopper, CUTLASS,
  rocBLAS/hipBLASLt `Cijk_*`) and attention (FlashAttention `flash_*`, memory-efficient
  `fmha_*`, cuDNN `*sdpa*`, AOTriton `attn_*`): the ops with FLOPs in the captured graph
  (`trainplan.modeling.flop_counting`'s convention counts attention's matmuls), whose time the profile's
  `matmul_efficiency` curve sets;
- `communication`: NCCL and RCCL kernels (`ncclDevKernel_*`, `ncclKernel_*`): collectives, the
  profile's `network_efficiency` (their time includes waiting for the slowest rank);
- `other`: the rest (elementwise, reductions, the optimizer's foreach kernels, copies and
  memsets), memory-bound, the profile's `memory_efficiency`.

`busy` is the length of the union of all kernel intervals: what the device was doing at all,
overlapped communication counted once; the step's wall time beyond it is host overhead (launch,
dispatch, Python), the profile's `op_overhead_s`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["KINDS", "PROFILED_STEPS", "kernel_kind", "merge_splits", "profile_step", "split_kernels"]

PROFILED_STEPS = (4, 5)
"""Steps profiled on an accelerator: after the two warm-up steps, the MemTracker step (2) and the
FlopCounterMode step (3) (`trainplan.executor.measure.WARMUP_STEPS_UNMEASURED`); not timed into
`RunRecord.step_times_s` (the profiler adds host time)."""

KINDS = ("matmul", "communication", "other")
"""The kinds of device time, in `RunRecord.kernel_time_s`'s order."""

_HOST = re.compile(r"^(?:cuda|hip|cu)[A-Z]|^Activity Buffer")
"""Host-side events the tracer may tag with the device (runtime and driver API calls such as
`cudaLaunchKernel`, `hipMemcpyAsync`; CUPTI's buffer requests): not device time."""
_COMMUNICATION = re.compile(r"nccl|rccl|msccl", re.IGNORECASE)
_MATMUL = re.compile(r"gemm|cutlass|xmma|wgmma|nvjet|cublas|hipblas|rocblas|cijk_|flash|fmha|sdpa|attn|attention",
                     re.IGNORECASE)


def kernel_kind(name: str) -> str:
    """`communication`, `matmul` or `other` for a device kernel's name (module docstring), e.g.
    `ncclDevKernel_AllGather_RING_LL` -> communication, `nvjet_tst_128x256_64x4_2x1_v_bz_TNT`
    -> matmul, `vectorized_elementwise_kernel<...>` -> other."""
    if _COMMUNICATION.search(name):
        return "communication"
    if _MATMUL.search(name):
        return "matmul"
    return "other"


def split_kernels(kernels: Iterable[tuple[str, float, float]]) -> dict[str, float]:
    """Seconds by kind of the device kernels `(name, start_s, end_s)`, and `busy`: the length of
    the union of their intervals (overlapping kernels, e.g. an all-gather beside a GEMM, count
    once). Kernels of zero or negative length count 0."""
    out = dict.fromkeys(KINDS, 0.0)
    spans = []
    for name, start, end in kernels:
        if end > start:
            out[kernel_kind(name)] += end - start
            spans.append((start, end))
    busy, reach = 0.0, -float("inf")
    for start, end in sorted(spans):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    out["busy"] = busy
    return out


def merge_splits(old: dict[str, float] | None, new: dict[str, float]) -> dict[str, float]:
    """The mean per step over `old` (a mean over `old["steps"]` steps, or None) and one more step
    `new` (seconds by kind, `busy` and `wall`); `steps` counts them."""
    if not old:
        return {**new, "steps": 1.0}
    n = old.get("steps", 1.0)
    merged = {k: (old.get(k, 0.0) * n + v) / (n + 1) for k, v in new.items()}
    merged["steps"] = n + 1
    return merged


def _activity(dev: torch.device):
    """The profiler activity of `dev`'s kernels (CUDA for CUDA and ROCm, XPU, ...), or None
    when torch's profiler has none for it (then nothing is profiled)."""
    from torch.profiler import ProfilerActivity

    return getattr(ProfilerActivity, dev.type.upper(), None) if dev.type != "cpu" else None


def profile_step(fn: Callable[[], Any], dev: torch.device) -> tuple[Any, dict[str, float] | None]:
    """Run `fn()` (one training step) under `torch.profiler` on `dev`'s device activity; returns
    its result and the step's `split_kernels` with `wall` (seconds, the device synchronized
    before and after), or None for the split on a CPU or a device the profiler cannot trace."""
    activity = _activity(dev)
    if activity is None:
        return fn(), None
    from torch.autograd import DeviceType
    from torch.profiler import profile

    torch.accelerator.synchronize(dev)
    with profile(activities=[activity]) as prof:
        t0 = time.perf_counter()
        result = fn()
        torch.accelerator.synchronize(dev)
        wall = time.perf_counter() - t0
    kernels = [(e.name, e.time_range.start * 1e-6, e.time_range.end * 1e-6)  # microseconds
               for e in (prof.events() or []) if e.device_type != DeviceType.CPU and not _HOST.match(e.name)]
    return result, {**split_kernels(kernels), "wall": wall}
