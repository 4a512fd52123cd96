"""The one home of trainplan's private torch APIs: each with its torch module, its users and why
no public API serves (`PRIVATE`), imported on first use.

torch promises nothing about a name under a module whose path has a segment starting with `_`
(`torch._subclasses`, `torch.utils._python_dispatch`, `torch.distributed.fsdp._fully_shard`...):
a minor release may move or drop it. So trainplan imports such names here alone, as
`from trainplan.modeling.torch_private import FakeTensorMode`, and declares the torch it tested them
with as the requirement's ceiling (`TORCH_REQUIREMENT`, the `torch` line of pyproject.toml).
`tests/unit/modeling/test_torch_private.py` resolves every entry under the installed torch and
checks that no other source file imports a private torch module.

Each name is imported when first used (PEP 562 module `__getattr__`): importing this module
imports no torch, and using `FakeTensorMode` does not import FSDP's internals. A name that the
installed torch lacks (a release outside the tested range moved it) raises a `TrainplanError`
naming the private API, the installed torch and the tested range, e.g. "trainplan 0.1.0 is tested
with torch 2.13; torch 2.14.0 has no torch.utils._python_dispatch._get_current_dispatch_mode_stack
(used by trainplan.executor.accumulation): pip install 'torch>=2.13,<2.14'".

Names are re-exported without a leading underscore (`get_current_dispatch_mode` for torch's
`_get_current_dispatch_mode`): no module imports a private name of another
(`tests/unit/test_import_graph.py`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainplan.errors import TrainplanError

if TYPE_CHECKING:  # the real types for mypy; at run time each name is resolved by __getattr__
    from torch import _meta_registrations as meta_registrations
    from torch._functorch._activation_checkpointing.knapsack import dp_knapsack, greedy_knapsack, ilp_knapsack
    from torch._ops import OpOverload
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        FakeTensorMode,
    )
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode as get_current_dispatch_mode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as get_current_dispatch_mode_stack

TESTED_TORCH = "2.13"
"""The torch minor release every entry of `PRIVATE` was tested with."""
TORCH_REQUIREMENT = "torch>=2.13,<2.14"
"""The torch requirement of pyproject.toml: the tested release, its ceiling set by the names below."""


@dataclass(frozen=True)
class Private:
    """One private torch API trainplan uses."""

    target: str
    """Where torch defines it: "module.path:attr", or "module.path" for a module."""
    used_by: tuple[str, ...]
    """The trainplan modules that import it from here."""
    use: str
    """What they use it for."""
    why: str
    """Why no public torch API serves."""

    @property
    def dotted(self) -> str:
        """The API as one dotted name, e.g. "torch._ops.OpOverload"."""
        return self.target.replace(":", ".")


_FAKE = "torch._subclasses.fake_tensor"
_DISPATCH = "torch.utils._python_dispatch"
_KNAPSACK = "torch._functorch._activation_checkpointing.knapsack"
_FSDP_COLLECTIVES = "torch.distributed.fsdp._fully_shard._fsdp_collectives"
_KNAPSACK_WHY = ("torch.compile's memory-budget partitioner (`activation_memory_budget`) runs these solvers "
                 "internally; torch exports no entry to them")

PRIVATE: dict[str, Private] = {
    "FakeTensorMode": Private(
        f"{_FAKE}:FakeTensorMode", ("trainplan.planner.capture.graph", "trainplan.executor.apply.checkpointing"),
        "tracing a model's forward and backward on fake tensors: shapes and ops, no memory, no compute",
        "fake tensors have no public home in torch 2.13 (torch's docs and torch.export use this module)"),
    "DataDependentOutputException": Private(
        f"{_FAKE}:DataDependentOutputException", ("trainplan.planner.capture.errors",),
        "telling a capture that read tensor values (.item(), branching on values) from other failures",
        "fake-tensor errors are defined beside FakeTensorMode only"),
    "DynamicOutputShapeException": Private(
        f"{_FAKE}:DynamicOutputShapeException", ("trainplan.planner.capture.errors",),
        "telling a capture through an op of data-dependent output shape (nonzero) from other failures",
        "fake-tensor errors are defined beside FakeTensorMode only"),
    "OpOverload": Private(
        "torch._ops:OpOverload", ("trainplan.planner.capture.errors",),
        "finding the aten op a capture failed in (isinstance on an exception's `func` and traceback frames)",
        "the class of `torch.ops.aten.<op>.<overload>` objects is exported by no public module's __all__"),
    "TorchDispatchMode": Private(
        f"{_DISPATCH}:TorchDispatchMode", ("trainplan.executor.apply.checkpointing",),
        "the base class of the op recorder that checks a plan's checkpointed ops against the captured ones",
        "torch documents __torch_dispatch__ modes with this class, in this module only (torch.overrides has "
        "TorchFunctionMode, not it)"),
    "get_current_dispatch_mode_stack": Private(
        f"{_DISPATCH}:_get_current_dispatch_mode_stack", ("trainplan.executor.accumulation",),
        "finding a MemTracker measuring the step, to reset its module statistics between micro-steps",
        "torch has no public accessor of the active dispatch modes"),
    "get_current_dispatch_mode": Private(
        f"{_DISPATCH}:_get_current_dispatch_mode", ("trainplan.executor.optimizers",),
        "keeping torchao's 4-bit AdamW eager (not compiled) under a measuring dispatch mode",
        "torch has no public accessor of the active dispatch mode"),
    "pytree": Private(
        "torch.utils._pytree", ("trainplan.planner.capture.graph", "trainplan.planner.capture.layout"),
        "flattening and rebuilding a block's call arguments, with the node types torch and transformers register",
        "torch 2.13 has no public pytree module (torch.utils.pytree does not exist there)"),
    "dp_knapsack": Private(
        f"{_KNAPSACK}:dp_knapsack", ("trainplan.planner.joint.remat_strategies",),
        "the torch_knapsack_dp baseline checkpoint strategy", _KNAPSACK_WHY),
    "greedy_knapsack": Private(
        f"{_KNAPSACK}:greedy_knapsack", ("trainplan.planner.joint.remat_strategies",),
        "the torch_knapsack_greedy baseline checkpoint strategy", _KNAPSACK_WHY),
    "ilp_knapsack": Private(
        f"{_KNAPSACK}:ilp_knapsack", ("trainplan.planner.joint.remat_strategies",),
        "the torch_knapsack_ilp baseline checkpoint strategy", _KNAPSACK_WHY),
    "DefaultAllGather": Private(
        f"{_FSDP_COLLECTIVES}:DefaultAllGather", ("trainplan.executor.parallel.collectives",),
        "FSDP2's default all-gather, subclassed to free its buffers at a fixed point on gloo",
        "FSDPModule.set_custom_all_gather is public, the default it replaces is not exported"),
    "DefaultReduceScatter": Private(
        f"{_FSDP_COLLECTIVES}:DefaultReduceScatter", ("trainplan.executor.parallel.collectives",),
        "FSDP2's default reduce-scatter, subclassed to free its buffers at a fixed point on gloo",
        "FSDPModule.set_custom_reduce_scatter is public, the default it replaces is not exported"),
    "MemTracker": Private(
        "torch.distributed._tools.mem_tracker:MemTracker", ("trainplan.executor.measure",),
        "a step's peak memory by category (parameters, gradients, optimizer states, activations)",
        "torch's only tracker of memory by category lives in the private torch.distributed._tools"),
    "meta_registrations": Private(
        "torch._meta_registrations", ("trainplan.modeling.fake_run",),
        "patching the meta kernel of aten._grouped_mm (`_meta_grouped_mm_common`) to accept fp32 on fake tensors",
        "meta kernels are registered from this module; torch has no public way to wrap a registered one"),
}
"""Every private torch API trainplan uses, by the name trainplan imports it as."""

__all__ = ["PRIVATE", "TESTED_TORCH", "TORCH_REQUIREMENT", "Private", "resolve",  # and every name of PRIVATE:
           "DataDependentOutputException", "DefaultAllGather", "DefaultReduceScatter", "DynamicOutputShapeException",
           "FakeTensorMode", "MemTracker", "OpOverload", "TorchDispatchMode", "dp_knapsack",
           "get_current_dispatch_mode", "get_current_dispatch_mode_stack", "greedy_knapsack", "ilp_knapsack",
           "meta_registrations", "pytree"]


def _trainplan_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trainplan")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


def resolve(name: str) -> Any:
    """The torch object `PRIVATE[name]` names, imported now.

    Raises:
        KeyError: `name` is not in `PRIVATE`.
        TrainplanError: the installed torch lacks it; names the private API, the installed torch
            version, the tested one and the requirement to install.
    """
    entry = PRIVATE[name]
    module, _, attr = entry.target.partition(":")
    try:
        found = importlib.import_module(module)
        return getattr(found, attr) if attr else found
    except (ImportError, AttributeError) as err:
        import torch

        why = (str(err).splitlines() or [type(err).__name__])[0]
        raise TrainplanError(
            f"trainplan {_trainplan_version()} is tested with torch {TESTED_TORCH}; torch {torch.__version__} has "
            f"no {entry.dotted} (used by {', '.join(entry.used_by)}; {why}): pip install '{TORCH_REQUIREMENT}'"
        ) from err


def __getattr__(name: str) -> Any:
    if name not in PRIVATE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = resolve(name)
    globals()[name] = value  # resolved once: later uses find it without __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(PRIVATE))
