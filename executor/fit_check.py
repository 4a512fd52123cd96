"""Whether a plan can run on this machine: its processes and its predicted memory.

`trainplan.executor.train.run` (one process) and `trainplan.executor.worker.launch` (the torchrun parent) call
`check_fits` before the model is built, so that a plan solved for other hardware fails with one
line naming both numbers instead of swapping, being OOM-killed or failing in a worker:

- CPU: this host's processes (all `decisions.devices` of them under torchrun `--standalone`,
  `devices / nnodes` on each of several nodes) must
  number at most `CPU_PROCESSES_PER_CORE` per core, and together their predicted peak
  (`predictions.memory_bytes["total"]` per device, tensor bytes) must fit the RAM available now
  (psutil's `virtual_memory().available` when installed, else /proc/meminfo's MemAvailable;
  either capped by the cgroup limit). Torch's own runtime in each process (a few hundred MiB of
  libraries) is not in the prediction and not counted here.
- CUDA/ROCm: one process per device; there must be as many here as this host's processes
  (`torch.cuda.device_count()`), and the predicted per-device peak must fit each device's free
  memory (`torch.cuda.mem_get_info`). The parent checks the count only (querying free memory
  would open a CUDA context on every device in the parent); each worker checks its own device.
"""

from __future__ import annotations

import os

import torch

from trainplan.errors import PlanMismatchError
from trainplan.hardware_profiles import cpu_probes
from trainplan.planner.plan import Plan, edited_layout

CPU_PROCESSES_PER_CORE = 4
"""Most processes per CPU core a plan may place on this host. benchmarks/sp.py runs 2 per core
(SP 4 on 2 cores) at about half speed; beyond 4 gloo's collectives wait on descheduled peers for
most of a step, and the per-process runtime memory outgrows the model's."""

SKIP_HINT = "or pass check_fits=False to trainplan.executor.train.run or trainplan.executor.worker.launch to try anyway"


class PlanDoesNotFitError(PlanMismatchError):
    """The plan's processes or predicted memory exceed this machine's; the message names both
    numbers and how to solve for this hardware."""


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


def available_ram_bytes() -> int:
    """RAM available to new processes now: psutil's estimate when installed, else MemAvailable;
    capped by this cgroup's memory limit."""
    try:
        import psutil  # optional: not a dependency of trainplan
    except ImportError:
        return cpu_probes.available_bytes()
    return min(int(psutil.virtual_memory().available), cpu_probes.total_ram_bytes())


def _solve_hint(plan: Plan, dev: torch.device) -> str:
    hw = "cpu" if dev.type == "cpu" else plan.hw
    return (f"solve for this hardware: trainplan solve --model {plan.model} --hw {hw} "
            f"--seq-len {plan.decisions.seq_len} ... (fewer devices, a shorter sequence or a "
            f"smaller micro-batch), {SKIP_HINT}")


def check_fits(plan: Plan, dev: torch.device, *, in_worker: bool = False,
               processes: int | None = None) -> None:
    """Raise `PlanDoesNotFitError` unless `plan` can run on `dev` here (see the module text).

    `in_worker`: called by one rank of a torchrun job (its launcher checked the host); only a
    CUDA rank's own device memory is checked then. `processes`: the plan's processes on this
    host (one node's share of a multi-node job); None: all `decisions.devices`.
    """
    d = plan.decisions
    n = d.devices if processes is None else processes
    here = "" if n == d.devices else f" ({n} of its {d.devices} on this node)"
    edited = edited_layout(plan)
    if edited:  # the memory checked below is the plan's prediction
        raise PlanMismatchError(f"plan: {edited}; solve again (or trainplan.planner.api.plan_for_choice) for the "
                                "edited layout")
    need = float(plan.predictions.memory_bytes.get("total", 0.0) or 0.0)
    if dev.type == "cpu":
        if in_worker:
            return
        cores = os.cpu_count() or 1
        if n > CPU_PROCESSES_PER_CORE * cores:
            raise PlanDoesNotFitError(
                f"plan runs {n} processes (one per device){here} but this machine has {cores} CPU "
                f"core(s): at most {CPU_PROCESSES_PER_CORE * cores} processes "
                f"({CPU_PROCESSES_PER_CORE} per core) can share it; {_solve_hint(plan, dev)}")
        have = available_ram_bytes()
        if n * need > have:
            raise PlanDoesNotFitError(
                f"plan needs {n} x {_gib(need)} = {_gib(n * need)} of RAM (predicted peak per "
                f"device x processes on this host) but this machine has {_gib(have)} available; "
                f"{_solve_hint(plan, dev)}")
        return
    if dev.type != "cuda":
        return
    count = torch.cuda.device_count()
    if not in_worker and n > count:
        raise PlanDoesNotFitError(
            f"plan uses {n} devices{here} but torch sees {count} {dev.type} device(s) here; "
            f"{_solve_hint(plan, dev)}")
    if not in_worker and d.devices > 1:
        return  # each worker checks its own device's free memory
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    if need > free:
        raise PlanDoesNotFitError(
            f"plan needs {_gib(need)} per device (predicted peak) but {dev.type}:{index} has "
            f"{_gib(free)} free of {_gib(total)}; {_solve_hint(plan, dev)}")
