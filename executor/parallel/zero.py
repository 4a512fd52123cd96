"""ZeRO stages 0-3 for the dp x sp world: DDP, DDP + ZeroRedundancyOptimizer, FSDP2 (`fully_shard`).

Model states are sharded over the dp x sp world that `trainplan.executor.parallel.ulysses` lays out (call
`apply_zero` after `enable_ulysses`). On CPU (gloo) FSDP2's all-gathers and reduce-scatters are
`trainplan.executor.parallel.collectives`' releasing variants, so that their buffers are freed at the same point
on every rank and run (what `trainplan.costmodels.step.fsdp` models).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from trainplan.errors import TrainplanError
from trainplan.executor.parallel.collectives import ReleasingAllGather, ReleasingReduceScatter

OptimizerFactory = Callable[[Iterable], torch.optim.Optimizer]
"""``optimizer_factory(params)``: the optimizer over an iterable of parameters or param-group dicts
(e.g. ``functools.partial(trainplan.executor.optimizers.build_optimizer, bits=..., lr=...)``)."""


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: modules whose class is in HF's ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names and m is not model]


def _resolve(mesh_or_group, device: torch.device):
    """(process group, 1-D DeviceMesh factory) for the sharding group; None = whole world."""
    if isinstance(mesh_or_group, DeviceMesh):
        mesh = mesh_or_group if mesh_or_group.ndim == 1 else mesh_or_group._flatten()
        return mesh.get_group(), lambda: mesh
    if mesh_or_group is None:
        world = dist.get_world_size()
        return dist.group.WORLD, lambda: init_device_mesh(device.type, (world,))
    group = mesh_or_group
    return group, lambda: DeviceMesh.from_group(group, device.type)


def _local_device(device: torch.device) -> torch.device:
    if device.type == "cpu" or device.index is not None:
        return device
    return torch.device(device.type, torch.accelerator.current_device_index())


def mixed_precision_policy(d):
    """FSDP2's `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` for a bf16-mixed plan
    at ZeRO 2/3 over more than one device (as torchtitan runs FSDP2): parameters all-gathered and
    computed in bf16, without autocast; gradients reduce-scattered and kept in fp32 beside the
    fp32 sharded parameters the optimizer steps. None otherwise (DDP and one device run
    bf16-mixed as `torch.autocast` over fp32 parameters). The step model prices the same
    (`trainplan.costmodels.step.model.StepModel.mixed_precision_policy`)."""
    if d.precision != "bf16-mixed" or d.zero_stage < 2 or d.devices == 1:
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


class _FactoryOptimizer:
    """Adapts ``optimizer_factory(params)`` to ZeroRedundancyOptimizer's ``optimizer_class(params,
    **defaults)``: the defaults (lr, betas, ...) already live in the param groups it passes."""

    def __init__(self, factory: OptimizerFactory):
        self.factory = factory

    def __call__(self, params, **_defaults) -> torch.optim.Optimizer:
        return self.factory(params)


def apply_zero(
    model: nn.Module,
    optimizer_factory: OptimizerFactory,
    *,
    stage: int,
    mesh_or_group=None,
    device: torch.device,
    mp_policy=None,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Shard model states over the dp x sp group and build the optimizer.

    ``optimizer_factory(params)`` returns the optimizer (AdamW, bitsandbytes AdamW8bit, ...); it
    gets an iterable of parameters or of param-group dicts. ``mesh_or_group``: a DeviceMesh (a
    2-D one is flattened), a ProcessGroup, or None for the whole world. Gradients are *averaged*
    over it, which is what `sp_loss` assumes.

    - stage 0: parameters replicated, gradients all-reduced by DDP (average).
    - stage 1: DDP plus ``ZeroRedundancyOptimizer``: optimizer states sharded, each rank steps its
      partition and broadcasts the updated parameters.
    - stage 2: FSDP2 ``fully_shard`` on each decoder layer and on the root, parameters kept
      unsharded between forward and backward (``reshard_after_forward=False``): gradients and
      optimizer states sharded, one all-gather per step.
    - stage 3: the same with ``reshard_after_forward=True``: parameters also sharded, re-gathered
      for backward.

    On CPU (gloo) stages 2 and 3 use `trainplan.executor.parallel.collectives`' all-gather and reduce-scatter:
    FSDP2's own, returning only once gloo's worker thread has released the buffers, so that
    they are freed where FSDP2 drops them (without it, one rank of a loaded run now and then
    held the root group's all-gather buffer into the next block's backward prefetch).

    The model is moved to ``device`` first. With world size 1 (or no process group) model and
    ``optimizer_factory(model.parameters())`` are returned unchanged. Note that DDP wraps the
    model (``model.module`` is the HF model); FSDP2 keeps its class. Call after `enable_ulysses`.
    ``mp_policy``: an FSDP2 ``MixedPrecisionPolicy`` for stages 2 and 3 (ignored below stage 2).
    """
    if stage not in (0, 1, 2, 3):
        raise TrainplanError(f"zero stage must be 0, 1, 2 or 3, got {stage!r}")
    device = _local_device(device)
    model = model.to(device)
    if not dist.is_initialized():
        return model, optimizer_factory(model.parameters())
    group, make_mesh = _resolve(mesh_or_group, device)
    if dist.get_world_size(group) == 1:
        return model, optimizer_factory(model.parameters())

    if stage in (0, 1):
        device_ids = None if device.type == "cpu" else [device]
        ddp = DDP(model, device_ids=device_ids, process_group=group)
        if stage == 0:
            return ddp, optimizer_factory(ddp.parameters())
        probe = optimizer_factory([nn.Parameter(torch.zeros(1, device=device))])
        defaults = {k: v for k, v in probe.defaults.items()}
        zero = ZeroRedundancyOptimizer(
            ddp.parameters(),
            # torch types optimizer_class as a class; it only calls optimizer_class(params, **defaults)
            optimizer_class=_FactoryOptimizer(optimizer_factory),  # type: ignore[arg-type]
            process_group=group,
            **defaults,
        )
        return ddp, zero

    mesh = make_mesh()
    reshard = stage == 3
    layers = _decoder_layers(model)
    if not layers:
        warnings.warn(
            f"{type(model).__name__} names no decoder-layer class in _no_split_modules; "
            "sharding the root module only (one all-gather for the whole model)",
            stacklevel=2,
        )
    extra = {} if mp_policy is None else {"mp_policy": mp_policy}
    for module in [*layers, model]:
        sharded = fully_shard(module, mesh=mesh, reshard_after_forward=reshard, **extra)  # module itself
        if device.type == "cpu":  # gloo: buffers freed where FSDP2 drops them (trainplan.executor.parallel.collectives)
            sharded.set_custom_all_gather(ReleasingAllGather())
            sharded.set_custom_reduce_scatter(ReleasingReduceScatter())
    return model, optimizer_factory(model.parameters())
