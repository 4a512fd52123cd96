"""`apply_plan`: a Plan applied to the user's own model, for the user's own training loop; the
`AppliedPlan` it returns (model, optimizer, LR schedule, batch counts, loss, measurements).

    >>> applied = trainplan.executor.apply_plan(plan, model)       # checkpoint sets, DDP/ZeRO/FSDP2, SP
    >>> with applied.measure("runs/mine") as m:          # plan.json + record.json for `trainplan report`
    ...     for step in range(applied.max_steps):
    ...         m.step(train_step)                       # the user's step: micro-steps, optimizer, scheduler

What is applied, in order (`trainplan.executor.train.run` trains through the same function):
1. the blocks: the model's one `nn.ModuleList` of `plan.model_n_layers` modules
   (`trainplan.executor.apply.checkpointing.find_blocks`), its parameter count the plan's;
2. the op check: each checkpointed block's forward, traced on fake tensors, runs the ops the plan
   captured (`trainplan.executor.apply.checkpointing.check_block_ops`), else `PlanMismatchError`;
3. the checkpoint sets (`trainplan.executor.apply.checkpointing.apply_checkpointing`);
4. over more than one process (torch.distributed, initialised here from torchrun's environment
   when it is not yet): the SP groups and Ulysses attention (`trainplan.executor.parallel.ulysses`), then
   DDP, ZeRO-1 or FSDP2 with the plan's mixed precision (`trainplan.executor.parallel.zero.apply_zero`),
   which also builds the optimizer;
5. the optimizer of the plan's state width (`trainplan.executor.optimizers.build_optimizer`) and a
   `LambdaLR` with the plan's warmup-stable-decay schedule (`lr_at`), its learning rate `lr_at(0)`.

`trainplan.executor.parallel.ulysses` and `trainplan.executor.parallel.zero` are imported by multi-device runs only:
they load transformers' attention interface and FSDP2's internals (seconds), which torch builds
without distributed support do not have.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from trainplan.costmodels.checkpoint_sets import resolve, sets_from_mapping
from trainplan.errors import PlanMismatchError, TrainplanError, UnknownNameError
from trainplan.executor.accumulation import accumulation_sync, reset_memory_tracker_modules
from trainplan.executor.apply.checkpointing import apply_checkpointing, block_ops, check_block_ops, find_blocks
from trainplan.executor.apply.measuring import Measurement
from trainplan.executor.optimizers import build_optimizer
from trainplan.executor.parallel.launch import init_distributed
from trainplan.hardware_profiles import load as load_profile
from trainplan.modeling.activation_compression import compress_saved_activations
from trainplan.modeling.loss import lm_loss
from trainplan.modeling.model_call import accepts_position_ids, forward_logits
from trainplan.modeling.offload import OffloadStats, offload_block
from trainplan.modeling.tiling import IGNORE_INDEX, TiledHead, find_mlp, tile_mlp
from trainplan.planner.plan import Plan


def resolve_device(plan: Plan, override: str | torch.device | None = None) -> torch.device:
    """The device a plan runs on: `override`, else the plan's profile's device type (for a profile
    read from a file, `--hw FILE.toml`, which `load` does not know by name: the accelerator here).

    Raises:
        TrainplanError: the plan targets an accelerator and none is present.
    """
    if override:
        return torch.device(override)
    if plan.hw == "cpu":  # no need to load (and maybe measure) the cpu profile in every rank
        return torch.device("cpu")
    try:
        kind = load_profile(plan.hw).device_type
    except UnknownNameError:
        kind = getattr(torch.accelerator.current_accelerator(check_available=True), "type", "cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        raise TrainplanError(
            f"plan targets {plan.hw!r} (a CUDA/ROCm device) but torch sees none here; "
            "run it with --device cpu to execute it on the CPU (times are then not compared)")
    return torch.device(kind)


def init_world(plan: Plan, dev: torch.device) -> tuple[int, int]:
    """(rank, world size) of this process: (0, 1) for a one-device plan; else the initialised
    process group's, or one initialised now from torchrun's environment (`init_distributed`).

    Raises:
        TrainplanError: the process count is not the plan's `devices`.
    """
    import torch.distributed as dist

    devices = plan.decisions.devices
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else int(
        os.environ.get("WORLD_SIZE", "1"))
    if world != devices:
        raise TrainplanError(
            f"plan uses {devices} device(s) but this process group has {world}: "
            "use `trainplan run PLAN --out DIR`, which launches torchrun with the plan's count, or "
            f"launch your script with `torchrun --nproc-per-node {devices}`")
    if world == 1:
        return 0, 1
    if dist.is_initialized():
        return dist.get_rank(), world
    return init_distributed(dev)


def lr_at(step: int, plan: Plan) -> float:
    """Warmup-stable-decay: linear warmup, constant, linear cooldown over the last 20% of the
    planned steps (Hu et al. 2024, MiniCPM; lets a run stop at any budget with a cooldown)."""
    d = plan.decisions
    peak = d.lr
    if step < d.warmup_steps:
        return peak * (step + 1) / d.warmup_steps
    cool = max(1, int(0.2 * d.max_steps))
    start = d.max_steps - cool
    return peak if step < start else peak * max(0.05, (d.max_steps - step) / cool)


def micro_batch_loss(model, dev, sp: int, sp_rank: int, world: int, x, y, *,
                     head: TiledHead | None = None) -> torch.Tensor:
    """Loss of one micro-batch (nats/token, a scalar): x, y (b, s) token ids and next-token
    targets, `model` on device `dev`, called as its forward accepts
    (`trainplan.modeling.model_call.forward_logits`: the logits as a tensor, `.logits`, a dict or a tuple).
    Under Ulysses SP (`sp` ranks per sequence, this one `sp_rank`, `world` ranks in all) each rank
    feeds its contiguous sequence shard with global positions; `trainplan.executor.parallel.ulysses.sp_loss`
    makes the averaged gradients equal the single-process ones. No KV cache (`use_cache=False`
    where the forward takes it): a training forward of a model whose config enables it would
    otherwise fill one, ops the plan did not capture. `head` (a tiled loss,
    `trainplan.modeling.tiling.TiledHead`): the model's logits are then the summed cross-entropy of its
    tokens, computed in `head.chunks` token chunks inside the forward, divided here by the tokens
    that take part (`trainplan.modeling.tiling.tiled_lm_loss`'s value)."""
    if world == 1:
        if head is None:
            return lm_loss(forward_logits(model, x.to(dev)), y.to(dev))
        with head.labels(y):
            total = forward_logits(model, x.to(dev), allow_scalar=True)
        return total / (y != IGNORE_INDEX).sum().to(total.device)
    from trainplan.executor.parallel.ulysses import sp_loss  # multi-device only: see the module docstring

    sl = x.shape[1] // sp
    lo, hi = sp_rank * sl, (sp_rank + 1) * sl
    pos: torch.Tensor | None = torch.arange(lo, hi, device=dev).unsqueeze(0).expand(x.shape[0], -1)
    if sp == 1 and not accepts_position_ids(model):
        pos = None  # data parallel only: the model's own positions are these (no check, no sync)
    labels = y[:, lo:hi].to(dev)
    if head is None:
        logits = forward_logits(model, x[:, lo:hi].to(dev), position_ids=pos)
        return sp_loss(logits, labels, None, None)
    with head.labels(labels):
        total = forward_logits(model, x[:, lo:hi].to(dev), position_ids=pos, allow_scalar=True)
    return sp_loss(total, labels, None, None, local_sum=total)


@dataclass(kw_only=True, eq=False)
class AppliedPlan:
    """A plan applied to a model (`apply_plan`): what a training loop needs from it."""

    plan: Plan
    model: nn.Module
    """The model to train: the user's, checkpointed per the plan; over several processes wrapped
    by DDP (ZeRO 0/1; `model.module` is the user's) or sharded in place by FSDP2 (ZeRO 2/3)."""
    optimizer: torch.optim.Optimizer
    """AdamW with the plan's state width (`trainplan.executor.optimizers.build_optimizer`); ZeRO-1's
    `ZeroRedundancyOptimizer` around it."""
    device: torch.device
    """Where the model trains (`resolve_device`)."""
    rank: int = 0
    """This process's rank in the world (0 on one process)."""
    world: int = 1
    """Processes in all: the plan's devices."""
    mixed_precision: Any = field(default=None, repr=False)
    """FSDP2's `MixedPrecisionPolicy` when the plan runs bf16-mixed under it, else None."""
    lr_scheduler: LambdaLR | None = field(default=None, repr=False)
    """`scheduler`, or None for `apply_plan(..., lr_scheduler=False)`."""
    head: TiledHead | None = field(default=None, repr=False)
    """The LM head made a tiled loss inside the forward (`trainplan.modeling.tiling.TiledHead`), else None."""
    offload_stats: OffloadStats | None = field(default=None, repr=False)
    """What activation offload moved to host memory in the last step (`Decisions.offload`)."""

    @property
    def micro_batch(self) -> int:
        """Sequences per micro-step on each data-parallel replica."""
        return self.plan.decisions.micro_batch

    @property
    def grad_accum(self) -> int:
        """Micro-steps per optimizer step."""
        return self.plan.decisions.grad_accum

    @property
    def seq_len(self) -> int:
        """Tokens per sequence (the whole sequence; `loss` feeds this rank its SP shard)."""
        return self.plan.decisions.seq_len

    @property
    def max_steps(self) -> int:
        """Optimizer steps the plan's token budget buys."""
        return self.plan.decisions.max_steps

    @property
    def dp_rank(self) -> int:
        """This process's data-parallel replica: which batches it reads (the ranks of one SP
        group read the same sequences)."""
        return self.rank // self.plan.decisions.sp_degree

    @property
    def dp_degree(self) -> int:
        """Data-parallel replicas, each reading its own batches."""
        return self.plan.decisions.dp_degree

    @property
    def scheduler(self) -> LambdaLR:
        """`LambdaLR` over `optimizer` with the plan's schedule (`lr_at`): call `step()` after
        each optimizer step. `apply_plan` makes it, so the first optimizer step runs at `lr_at(0)`."""
        if self.lr_scheduler is None:
            raise TrainplanError("this plan was applied with lr_scheduler=False: no scheduler was made")
        return self.lr_scheduler

    def autocast(self) -> AbstractContextManager:
        """The forward's autocast: bf16 for a bf16-mixed plan unless FSDP2's mixed-precision
        policy casts the parameters instead; else none."""
        if self.plan.decisions.precision == "bf16-mixed" and self.mixed_precision is None:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`micro_batch_loss` of this rank (its SP shard of (b, s) ids `x` and targets `y`),
        without the training contexts: held-out evaluation under `torch.no_grad()`."""
        d = self.plan.decisions
        return micro_batch_loss(self.model, self.device, d.sp_degree, self.rank % d.sp_degree, self.world, x, y,
                                head=self.head)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Training loss of one micro-batch (nats/token, a scalar with its graph): `x`, `y` (b, s)
        token ids and next-token targets on any device, b = `micro_batch`, s = `seq_len`; this rank
        feeds its SP shard. The forward runs under `autocast()` and the plan's saved-activation
        compression (`trainplan.modeling.activation_compression`); call `.backward()` on it (divided by
        `grad_accum` when accumulating) inside `accumulating(j)`.

        Raises:
            PlanMismatchError: `x` or `y` is not of shape (`micro_batch`, `seq_len`)."""
        d = self.plan.decisions
        if tuple(x.shape) != (d.micro_batch, d.seq_len) or tuple(y.shape) != tuple(x.shape):
            raise PlanMismatchError(
                f"loss got x of shape {tuple(x.shape)} and y of shape {tuple(y.shape)}; the plan's micro-batch "
                f"is (micro_batch, seq_len) = ({d.micro_batch}, {d.seq_len}) (its memory was planned for that)")
        reset_memory_tracker_modules()  # a MemTracker measuring this step sees each forward anew
        with self.autocast(), compress_saved_activations(self.plan.decisions.activation_bits):
            return self.forward_loss(x, y)

    def accumulating(self, j: int) -> AbstractContextManager:
        """The context of micro-step `j`'s (0-based) forward and backward: DDP's `no_sync()` for
        every micro-step but the last of an optimizer step (`trainplan.executor.accumulation`)."""
        d = self.plan.decisions
        return accumulation_sync(self.model, zero_stage=d.zero_stage, world=self.world,
                                 last=j == d.grad_accum - 1)

    def measure(self, out: str | Path) -> Measurement:
        """A context manager recording this run for trainplan's report into the folder `out`
        (`trainplan.executor.apply.measuring.Measurement`): `with applied.measure(out) as m: ... m.step(fn)`."""
        return Measurement(self, out)


def _lr_factor(step: int, plan: Plan) -> float:
    return lr_at(step, plan) / plan.decisions.lr


def apply_plan(plan: Plan, model: nn.Module, *, device_mesh=None, device: str | torch.device | None = None,
               check_ops: bool = True, lr_scheduler: bool = True) -> AppliedPlan:
    """Apply `plan` to `model` (a causal LM: its forward takes token ids and returns the logits,
    `trainplan.modeling.model_call.forward_logits`) for the caller's own training loop; the steps are the
    module docstring's.

    device: where to train (None: the plan's profile's device type, `resolve_device`); the model
        is moved there.
    device_mesh: over several processes, the `DeviceMesh` to shard over: 1-D (data parallel
        only) or 2-D with dimensions named `dp` and `sp` (`init_device_mesh(type, (dp, sp),
        mesh_dim_names=("dp", "sp"))`), its `sp` groups running Ulysses SP. None: the world laid
        out as the plan's dp_degree x sp_degree, SP groups of consecutive ranks (the same layout).
    check_ops: compare the checkpointed blocks' ops with the plan's (step 2); False skips it (the
        checkpoint sets' node keys then name whatever ops the model runs at those positions).
    lr_scheduler: make `scheduler` (its learning rate `lr_at(0)` from now); False: none, the
        caller sets the learning rate (`trainplan.executor.train.run`, whose checkpoints then keep the
        optimizer's param groups without LambdaLR's `initial_lr`, as before).

    Raises:
        PlanMismatchError: the model has no list of the plan's layer count, another parameter
            count, a checkpointed block whose ops differ from the captured ones (the first
            mismatching op), the plan names an unknown checkpoint entry, or it runs sequence
            parallelism and the model's forward takes no `position_ids`.
        TrainplanError: the process count is not the plan's devices; a `device_mesh` of another
            size or SP degree; an accelerator plan without an accelerator.
    """
    d = plan.decisions
    dev = resolve_device(plan, device)
    rank, world = init_world(plan, dev)
    blocks_name, blocks = find_blocks(model, plan.model_n_layers)
    n_params = sum(p.numel() for p in model.parameters())
    if n_params != plan.model_n_params:
        raise PlanMismatchError(f"plan was made for {plan.model} with {plan.model_n_params:,} "
                                f"parameters; this model has {n_params:,}")
    if d.sp_degree > 1 and not accepts_position_ids(model):  # on every rank, before any collective
        raise PlanMismatchError(
            f"the plan runs sequence parallelism (sp_degree={d.sp_degree}), which feeds each rank its "
            f"sequence shard with global positions, but {type(model).__name__}.forward takes no position_ids: "
            "give its forward a `position_ids` argument, or plan with sp_degree=1")
    model = model.to(dev)
    mp = None
    if world > 1:
        from trainplan.executor.parallel.zero import mixed_precision_policy  # see the module docstring

        mp = mixed_precision_policy(d)
    if d.mlp_chunks > 1:  # before the op check: the plan captured the tiled MLP's ops
        for layer in blocks:
            tile_mlp(find_mlp(layer), d.mlp_chunks)
    head = TiledHead(model, d.loss_chunks) if d.loss_chunks > 1 else None
    if check_ops:
        _check_ops(plan, model, blocks_name, blocks, dev, mixed_precision=mp is not None)
    apply_checkpointing(model, d.activation_checkpoint, d.checkpoint_sets, blocks=blocks, early_stop=d.mlp_chunks == 1)
    stats = _offload(d, blocks) if d.offload else None
    model.train()
    factory = partial(build_optimizer, bits=d.optimizer_bits, lr=d.lr, precision=d.precision)
    if world == 1:
        return _with_scheduler(AppliedPlan(plan=plan, model=model, optimizer=factory(model.parameters()),
                                           device=dev, head=head, offload_stats=stats), lr_scheduler)
    from trainplan.executor.parallel.ulysses import enable_ulysses  # see the module docstring
    from trainplan.executor.parallel.zero import apply_zero

    _sequence_parallel_group(d.sp_degree, world, device_mesh)
    enable_ulysses(model, seq_len=d.seq_len)
    wrapped, opt = apply_zero(model, factory, stage=d.zero_stage, mesh_or_group=device_mesh, device=dev,
                              mp_policy=mp)
    return _with_scheduler(AppliedPlan(plan=plan, model=wrapped, optimizer=opt, device=dev, rank=rank,
                                       world=world, mixed_precision=mp, head=head, offload_stats=stats),
                           lr_scheduler)


def _offload(d, blocks: nn.ModuleList) -> OffloadStats:
    """Activation offload on the checkpointed blocks (`trainplan.modeling.offload.offload_block`, outside
    their checkpoint, so only the checkpoint's saved input moves), one `OffloadStats` shared so
    the backward prefetches block i-1's input while block i runs."""
    stats = OffloadStats()
    sets = sets_from_mapping(d.checkpoint_sets)
    for layer, policy in zip(blocks, d.activation_checkpoint, strict=True):
        if resolve(policy, sets).checkpointed:
            offload_block(layer, stats=stats)
    return stats


def _with_scheduler(applied: AppliedPlan, make: bool) -> AppliedPlan:
    """`applied` with its `LambdaLR` made now (when `make`): a loop that first steps it after its
    first `optimizer.step()` runs that step at `lr_at(0)`, not the peak."""
    if make:
        applied.lr_scheduler = LambdaLR(applied.optimizer, partial(_lr_factor, plan=applied.plan))
    return applied


def _check_ops(plan: Plan, model: nn.Module, blocks_name: str, blocks: nn.ModuleList, dev: torch.device, *,
               mixed_precision: bool) -> None:
    """`check_block_ops` of the plan's checkpointed blocks traced as this run will execute them:
    parameters in bf16 without autocast under FSDP2's mixed precision, else their own dtype under
    the plan's autocast. Skipped for entries captured with another device type's kernels (a GPU
    plan run on the CPU) and for plans without the ops (written before they were recorded)."""
    d = plan.decisions
    expected = {k: v for k, v in d.checkpoint_block_ops.items() if v.get("device_type", "cpu") == dev.type}
    if not expected:
        return
    autocast = torch.bfloat16 if d.precision == "bf16-mixed" and not mixed_precision else None
    layers = sorted({i for v in expected.values() for i in v["layers"]})
    got = block_ops(model, blocks, layers, seq_len=d.seq_len, device=dev, micro_batch=d.micro_batch,
                    param_dtype=torch.bfloat16 if mixed_precision else None, autocast_dtype=autocast)
    check_block_ops(expected, got, blocks_name)


def _sequence_parallel_group(sp_degree: int, world: int, device_mesh) -> None:
    """Set Ulysses' SP group: `device_mesh`'s `sp` dimension, else consecutive ranks.

    Raises:
        TrainplanError: a mesh whose size is not `world`, or whose SP size is not `sp_degree`."""
    from trainplan.executor.parallel.ulysses import new_sequence_parallel_group, set_sequence_parallel_group

    if device_mesh is None:
        new_sequence_parallel_group(sp_degree)
        return
    names = tuple(device_mesh.mesh_dim_names or ())
    sp = device_mesh["sp"].size() if "sp" in names else 1
    if device_mesh.size() != world or sp != sp_degree or device_mesh.ndim > 2:
        raise TrainplanError(
            f"device_mesh of shape {tuple(device_mesh.shape)} (dimensions {names or 'unnamed'}) does not "
            f"lay out the plan's {world} devices with sp_degree={sp_degree}: give a 1-D mesh of {world} "
            f"(sp_degree 1) or a 2-D mesh named ('dp', 'sp') of shape ({world // sp_degree}, {sp_degree})")
    set_sequence_parallel_group(device_mesh["sp"].get_group() if sp > 1 else None)
