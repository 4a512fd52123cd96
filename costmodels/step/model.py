"""Cost of one training step for one choice of knobs: memory, FLOPs and time per device.

Composes the region lifetime simulation (`trainplan.costmodels.step.memory`), per-node FLOPs (torch's
`flop_counter` formulas, captured as polynomials) and a per-node roofline over the hardware
profile (`trainplan.costmodels.step.roofline`: Williams et al. 2009; efficiency curves as data, as
Calculon does, Isaev et al. 2023) and the collectives of Ulysses SP and ZeRO
(`trainplan.costmodels.step.comm`), overlapped with compute as the executor issues them
(`trainplan.costmodels.step.overlap`; `StepModel(overlap=False)` adds them instead, a conservative bound).
A step is one optimizer step of `Choice.grad_accum` micro-steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache

from trainplan.costmodels.checkpoint_sets import CheckpointSet, resolve, saved_nodes, sets_from_mapping
from trainplan.costmodels.graph import Region, variant_key
from trainplan.costmodels.step import comm
from trainplan.costmodels.step import memory as region_memory
from trainplan.costmodels.step.fsdp import FsdpLayout, root_gather_events
from trainplan.costmodels.step.memory import MemoryBreakdown, RegionMemory, model_state_bytes, simulate_region
from trainplan.costmodels.step.offload import copy_s, exposed_s, in_flight, offloaded
from trainplan.costmodels.step.optimizer_states import ADAMW_IMPLEMENTATION, adamw_traffic, optimizer_step_s
from trainplan.costmodels.step.overlap import StepTimes, bwd_stream_s, fwd_stream_s, step_timeline
from trainplan.costmodels.step.precision import PRECISIONS
from trainplan.costmodels.step.roofline import RegionCost, region_cost
from trainplan.costmodels.step.ulysses import ulysses_block_events
from trainplan.errors import TrainplanError
from trainplan.hardware_profiles import HardwareProfile


@dataclass(frozen=True, kw_only=True, slots=True)
class Choice:
    """One assignment of the step-shaping knobs."""

    sp_degree: int
    zero_stage: int
    micro_batch: int
    seq_len: int
    policies: tuple[str, ...]
    """Checkpoint menu entry per transformer block: a built-in name (`none`, `full`, ...) or
    the name of one of `sets`."""
    precision: str
    optimizer_bits: int
    devices: int
    activation_bits: int = 32
    """Saved-activation width outside checkpointed blocks (32 = as computed, 16, 8): the
    regions captured with that compression (`StepModel.region_name`)."""
    sets: tuple[CheckpointSet, ...] = field(default=())
    """Solved entries (`remat:k`) that `policies` may name."""
    grad_accum: int = 1
    """Micro-steps (forward + backward of `micro_batch` sequences) per optimizer step: gradient
    accumulation. `StepModel` prices one optimizer step of `grad_accum` micro-steps."""
    loss_chunks: int = 1
    """Sequence chunks the tail's LM head and loss run over (`trainplan.modeling.tiling.tiled_lm_loss`,
    the captured `tail@l{k}`); 1 = not tiled."""
    mlp_chunks: int = 1
    """Sequence chunks every block's MLP runs over (`trainplan.modeling.tiling.tile_mlp`, the captured
    `block{i}@m{k}`); 1 = not tiled. Above 1 the blocks' entries are `none` or `full`."""
    offload: bool = False
    """Checkpointed blocks' inputs held in host memory between forward and backward
    (`trainplan.modeling.offload`, priced by `trainplan.costmodels.step.offload`)."""

    @classmethod
    def from_decisions(cls, d) -> Choice:
        """The choice a Plan's `Decisions` (`trainplan.planner.plan`) fixes, its solved entries included."""
        return cls(sp_degree=d.sp_degree, zero_stage=d.zero_stage, micro_batch=d.micro_batch,
                   seq_len=d.seq_len, policies=tuple(d.activation_checkpoint), precision=d.precision,
                   optimizer_bits=d.optimizer_bits, devices=d.devices,
                   activation_bits=getattr(d, "activation_bits", 32),
                   grad_accum=getattr(d, "grad_accum", 1), loss_chunks=getattr(d, "loss_chunks", 1),
                   mlp_chunks=getattr(d, "mlp_chunks", 1), offload=getattr(d, "offload", False),
                   sets=tuple(sets_from_mapping(getattr(d, "checkpoint_sets", None)).values()))

    def entry(self, policy: str | CheckpointSet) -> CheckpointSet:
        """The CheckpointSet a policy name stands for in this choice.

        Raises:
            TrainplanError: unknown name."""
        return resolve(policy, {x.name: x for x in self.sets})


@dataclass(frozen=True, kw_only=True, slots=True)
class StepCost:
    """Predicted cost of one step on one device."""

    memory: MemoryBreakdown
    flops: float
    """FLOPs per device per step, recompute included."""
    model_flops: float
    """Without recompute."""
    compute_s: float
    """Roofline seconds of forward and backward ops."""
    recompute_s: float
    comm_s: float
    """Communication on the critical path (exposed), seconds; all of it when the model is built
    with `overlap=False`."""
    optimizer_s: float
    """Roofline seconds of the optimizer step (memory-bound)."""
    overhead_s: float
    """Per-op overhead: ops executed x the profile's `op_overhead_s`."""
    comm_total_s: float = 0.0
    """All collectives' seconds, hidden or not (what a no-overlap model adds)."""
    offload_s: float = 0.0
    """Activation offload's copies on the critical path (`trainplan.costmodels.step.offload.exposed_s`)."""
    host_bytes: float = 0.0
    """Host memory per device holding offloaded activations (`Choice.offload`)."""

    @property
    def time_s(self) -> float:
        return (self.compute_s + self.recompute_s + self.comm_s + self.optimizer_s + self.overhead_s
                + self.offload_s)

    def breakdown(self) -> dict[str, float]:
        """Seconds per step by part; they add up to `time_s`."""
        return {"compute": self.compute_s, "recompute": self.recompute_s,
                "communication": self.comm_s, "optimizer": self.optimizer_s,
                "overhead": self.overhead_s, "offload": self.offload_s}


class StepModel:
    """Evaluates `Choice`s for one captured model on one hardware profile, caching per-region
    results (a solver asks for many choices that share regions)."""

    def __init__(self, regions: Mapping[str, Region], blocks: tuple[str, ...], param_numels: tuple[int, ...],
                 hw: HardwareProfile, *, n_heads: int, n_kv_heads: int, head_dim: int, overlap: bool = True):
        self.regions, self.blocks, self.param_numels, self.hw = regions, blocks, param_numels, hw
        self.overlap = overlap
        """True: communication overlapped with compute as executed (`trainplan.costmodels.step.overlap`);
        False: every collective added to compute (a conservative bound)."""
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self._mem = lru_cache(maxsize=None)(self._region_memory)
        self._cost = lru_cache(maxsize=None)(self._region_cost)
        self._tail_root = lru_cache(maxsize=None)(self._tail_root_memory)
        self._states = lru_cache(maxsize=None)(self._model_states)
        self._param_bytes = lru_cache(maxsize=None)(lambda name: self.regions[name].param_bytes())

    def model_states(self, c: Choice):
        """Per-device model states (`trainplan.costmodels.step.memory.model_state_bytes`, as executed) at `c`'s
        precision, optimizer bits, ZeRO stage and device count; under FSDP2's mixed-precision
        policy each block's gradient shard is kept at the reduce width (`ModelStates.grad_scale`)."""
        return self._states(c.precision, c.optimizer_bits, c.zero_stage, c.devices)

    def _model_states(self, precision: str, optimizer_bits: int, zero_stage: int, devices: int):
        wb, gb, master, _ = PRECISIONS[precision]
        states = model_state_bytes(self.param_numels, weight_bytes=wb, grad_bytes=gb, master_bytes=master,
                                   optimizer_bits=optimizer_bits, zero_stage=zero_stage,
                                   shard_degree=devices, adamw=ADAMW_IMPLEMENTATION, as_executed=True)
        if precision == "bf16-mixed" and zero_stage >= 2 and devices > 1:
            # FSDP2's mixed-precision policy: a block's bf16 gradients (the `@mp` regions') are
            # kept as fp32 shards once reduce-scattered (`mixed_precision_policy`)
            states = replace(states, grad_scale=states.grad_scale * gb / 2)
        return states

    def region_name(self, name: str, activation_bits: int, policy: str | CheckpointSet = "none", *,
                    mixed_precision_policy: bool = False, chunks: int = 1) -> str:
        """The captured region that runs `name`: under FSDP2's mixed-precision policy
        (`mixed_precision_policy`, see the method of that name) its variant `name@mp`, traced with
        bf16 parameters and no autocast; then, with saved activations at `activation_bits` < 32
        outside a checkpointed entry (torch's checkpoint hooks take precedence over the
        compression's, `trainplan.modeling.activation_compression`), the variant `...@a{bits}` captured
        under the compression. `chunks` > 1: the sequence-tiled variant (`variant_key`: `@m{k}` for
        a block's MLP, `@l{k}` for the tail's loss), which the region table traces on first use.

        Raises:
            TrainplanError: the variant was not captured (capture with `activation_bits`, or
                at bf16-mixed, which captures the `@mp` variants), or cannot be tiled."""
        base = f"{name}@mp" if mixed_precision_policy else name
        if base not in self.regions:
            raise TrainplanError(
                f"bf16-mixed under FSDP2 needs the regions captured with bf16 parameters ({base!r} is "
                "missing): capture the model at precision 'bf16-mixed' (trainplan.planner.capture.setup.capture_model)")
        bits = 32 if activation_bits == 32 or resolve(policy).checkpointed else activation_bits
        variant = variant_key(name, mixed_precision=mixed_precision_policy, activation_bits=bits, chunks=chunks)
        if variant == base:
            return base
        if chunks > 1 and variant not in self.regions:
            raise TrainplanError(f"{name!r} cannot run over {chunks} sequence chunks: the capture could "
                                 f"not trace {variant!r} (a block without an MLP, or a sentinel collision)")
        if variant not in self.regions:
            raise TrainplanError(
                f"activation_bits={activation_bits} needs the regions captured with that "
                f"compression ({variant!r} is missing): capture with activation_bits=({activation_bits},)")
        return variant

    def region_for(self, c: Choice, name: str, policy: str | CheckpointSet = "none") -> str:
        """`region_name` of `name` under `c`'s activation width, precision policy and tiling
        (`Choice.loss_chunks` for the tail, `Choice.mlp_chunks` for blocks).

        Raises:
            TrainplanError: a tiled MLP under a selective entry (only `none` and `full` nest a
                tiled MLP's chunk checkpoints as `trainplan.modeling.tiling` runs them)."""
        chunks = c.loss_chunks if name == "tail" else 1 if name == "head" else c.mlp_chunks
        if chunks > 1 and name not in ("head", "tail") and resolve(policy).name not in ("none", "full"):
            raise TrainplanError(f"mlp_chunks={c.mlp_chunks} runs with the checkpoint entries none and "
                                 f"full only, not {resolve(policy).name!r}")
        return self.region_name(name, c.activation_bits, policy,
                                mixed_precision_policy=self.mixed_precision_policy(c), chunks=chunks)

    def _region_memory(self, name: str, b: int, s: int, policy: str | CheckpointSet,
                       sp: int = 1) -> RegionMemory:
        entry = resolve(policy)
        region = self.regions[name]
        saved = saved_nodes(region, entry)
        extra = ulysses_block_events(region, b, s, sp_degree=sp, n_heads=self.n_heads,  # sp > 1
                                     n_kv_heads=self.n_kv_heads, checkpoint=entry.checkpointed,
                                     saved_ops=saved)
        return simulate_region(region, b, s, checkpoint=entry.checkpointed, saved_ops=saved,
                               extra=extra)

    def _tail_root_memory(self, name: str, b: int, s: int, root_bytes: float) -> RegionMemory:
        region = self.regions[name]
        return simulate_region(region, b, s, extra=root_gather_events(region, root_bytes))

    def _region_cost(self, name: str, b: int, s: int, sp: int, policy: str | CheckpointSet,
                     dtype: str) -> RegionCost:
        return region_cost(self.regions[name], b, s, sp, policy, self.hw, dtype)

    def block_memory(self, c: Choice, i: int, policy: str | CheckpointSet) -> RegionMemory:
        """Lifetime summary of block i under checkpoint entry `policy` at `c`'s shape, with
        Ulysses' exchanges around attention when `c.sp_degree` > 1 (`trainplan.costmodels.step.ulysses`),
        its input in host memory when `c.offload` and the entry checkpoints
        (`trainplan.costmodels.step.offload.offloaded`)."""
        entry = c.entry(policy)
        m = self._mem(self.region_for(c, self.blocks[i], entry), c.micro_batch,
                      c.seq_len // c.sp_degree, entry, c.sp_degree)
        return offloaded(m, self.hw) if c.offload and entry.checkpointed else m

    def offload_block_s(self, c: Choice, i: int, policy: str | CheckpointSet) -> float:
        """Seconds block i's offloaded input adds to a micro-step (`trainplan.costmodels.step.offload.exposed_s`,
        overlapped with its own forward and backward); 0 without offload or checkpointing."""
        entry = c.entry(policy)
        if not (c.offload and entry.checkpointed):
            return 0.0
        x = self.block_cost(c, i, entry)
        nbytes = self.block_memory(c, i, entry).input_bytes
        return exposed_s(nbytes, x.fwd_s, x.bwd_s + x.recompute_s, self.hw)

    def block_cost(self, c: Choice, i: int, policy: str | CheckpointSet) -> RegionCost:
        """FLOPs and roofline seconds of block i under entry `policy` at `c`'s shape."""
        entry = c.entry(policy)
        return self._cost(self.region_for(c, self.blocks[i], entry), c.micro_batch,
                          c.seq_len // c.sp_degree, c.sp_degree, entry, PRECISIONS[c.precision][3])

    def block_time(self, c: Choice, i: int, policy: str | CheckpointSet) -> float:
        """Seconds of block i per step: forward, backward, recompute and per-op overhead."""
        x = self.block_cost(c, i, policy)
        return (x.fwd_s + x.bwd_s + x.recompute_s + x.n_ops * self.hw.op_overhead_s
                + self.offload_block_s(c, i, policy))

    def evaluate(self, c: Choice) -> StepCost:
        """Memory, FLOPs and time of one step under `c`, per device."""
        fsdp = self.fsdp_layout(c)
        states = self.model_states(c)
        head = self.head_memory(c)
        tail = self.tail_memory(c)
        blocks = [self.block_memory(c, i, p) for i, p in enumerate(c.policies)]
        held = states.grads if c.grad_accum > 1 else 0.0
        memory = region_memory.step_peak(head, blocks, tail, states, fsdp=fsdp, held_grad_bytes=held)
        return replace(self._with_runtime(c, memory), host_bytes=sum(m.offloaded_bytes for m in blocks))

    def tail_memory(self, c: Choice) -> RegionMemory:
        """Lifetime summary of the tail (final norm, LM head, loss) at `c`'s shape; with ZeRO-3
        over more than one device it includes FSDP2's root group, resharded during the loss
        and all-gathered again for the backward (`trainplan.costmodels.step.fsdp.root_gather_events`)."""
        b, s = c.micro_batch, c.seq_len // c.sp_degree
        fsdp = self.fsdp_layout(c)
        name = self.region_for(c, "tail")
        if fsdp is not None and fsdp.reshard_after_forward:
            m = self._tail_root(name, b, s, fsdp.root_param_bytes)
        else:
            m = self._mem(name, b, s, "none")
        return in_flight(m, self.hw) if c.offload else m

    def head_memory(self, c: Choice) -> RegionMemory:
        """Lifetime summary of the head (embedding, rotary tables) at `c`'s shape."""
        return self._mem(self.region_for(c, "head"), c.micro_batch,
                         c.seq_len // c.sp_degree, "none")

    def fsdp_layout(self, c: Choice) -> FsdpLayout | None:
        """FSDP2's all-gathered groups at `c` (ZeRO 2/3 over more than one device), else None.
        Groups are gathered at `gather_bytes_per_param`: the root group's parameters are all
        parameters less the blocks'. Under the mixed-precision policy the blocks' bf16 gradients
        are reduce-scattered in fp32 (`FsdpLayout.reduce_upcast` = 2)."""
        if c.zero_stage < 2 or c.devices == 1:
            return None
        gb = self.gather_bytes_per_param(c)
        numels = [self.block_numel(c.precision, name) for name in self.blocks]
        root = max(0.0, sum(self.param_numels) - sum(numels))
        mp = self.mixed_precision_policy(c)
        return FsdpLayout(root_param_bytes=root * gb, block_param_bytes=tuple(x * gb for x in numels),
                          shard_degree=c.devices, reshard_after_forward=c.zero_stage == 3,
                          reduce_scatter_copy=self.hw.device_type == "cpu",
                          reduce_upcast=self.reduce_bytes_per_param(c) / 2 if mp else 1.0)

    def runtime(self, c: Choice) -> StepCost:
        """FLOPs and time of one step under `c`, without the memory replay (its `memory` is an
        empty breakdown with phase `not evaluated`): what a solver needs per candidate."""
        return self._with_runtime(c, MemoryBreakdown(phase="not evaluated"))

    def _with_runtime(self, c: Choice, memory: MemoryBreakdown) -> StepCost:
        b, s, sp = c.micro_batch, c.seq_len // c.sp_degree, c.sp_degree
        dtype = PRECISIONS[c.precision][3]
        head, tail = (self._cost(self.region_for(c, r), b, s, sp, "none", dtype) for r in ("head", "tail"))
        blocks = [self.block_cost(c, i, p) for i, p in enumerate(c.policies)]
        costs = [head, tail, *blocks]
        ga = c.grad_accum
        model_flops = ga * sum(x.fwd_flops + x.bwd_flops for x in costs)
        recompute_flops = ga * sum(x.recompute_flops for x in costs)
        shard = c.devices if c.zero_stage >= 1 else 1
        opt_bytes, opt_ops = adamw_traffic(sum(self.param_numels) / shard, len(self.param_numels), c.optimizer_bits)
        comm_total_s, comm_exposed_s = self.comm_times(c, head, tail, blocks)
        offload_s = 0.0
        if c.offload:  # each block's copies beyond its compute, and the backward's first fetch
            offload_s = ga * sum(self.offload_block_s(c, i, p) for i, p in enumerate(c.policies))
            last = [i for i, p in enumerate(c.policies) if c.entry(p).checkpointed]
            if last and not self.hw.unified_memory:
                offload_s += ga * copy_s(self.block_memory(c, last[-1], c.policies[last[-1]]).input_bytes,
                                         self.hw)
        return StepCost(memory=memory, flops=model_flops + recompute_flops, model_flops=model_flops,
                        compute_s=ga * sum(x.fwd_s + x.bwd_s for x in costs),
                        recompute_s=ga * sum(x.recompute_s for x in costs), offload_s=offload_s,
                        comm_s=comm_exposed_s if self.overlap else comm_total_s, comm_total_s=comm_total_s,
                        optimizer_s=optimizer_step_s(self.hw, c.optimizer_bits, sum(self.param_numels) / shard,
                                                     opt_bytes),
                        overhead_s=(ga * sum(x.n_ops for x in costs) + opt_ops) * self.hw.op_overhead_s)

    def comm_times(self, c: Choice, head: RegionCost, tail: RegionCost,
                   blocks: list[RegionCost]) -> tuple[float, float]:
        """(all collectives, exposed) seconds of one optimizer step under `c`.

        The collectives: Ulysses' all-to-alls inside each block's attention (forward and
        backward, `comm.ULYSSES_PER_STEP_FACTOR`), on the critical path; the ZeRO stage's
        all-gathers and reduce-scatters (FSDP2) or all-reduces (DDP) per block and root group,
        overlapped with compute as the executor issues them (`trainplan.costmodels.step.overlap`); ZeRO-1's
        parameter broadcast after the optimizer step, exposed. Gathered parameters are at the
        precision's gather width (`gather_bytes_per_param`), reduced gradients at its reduce
        width (`reduce_bytes_per_param`)."""
        if c.devices == 1:
            return 0.0, 0.0
        ov = self.hw.op_overhead_s
        a2a = 0.0
        if c.sp_degree > 1:
            per = comm.ulysses_all_to_all_bytes(
                micro_batch=c.micro_batch, seq_len=c.seq_len, n_heads=self.n_heads,
                n_kv_heads=self.n_kv_heads, head_dim=self.head_dim, sp_degree=c.sp_degree,
                bytes_per_element=PRECISIONS[c.precision][0] if c.precision != "bf16-mixed" else 2)
            a2a = sum(comm.all_to_all_s(v, c.sp_degree, comm.link_for(self.hw, c.sp_degree)) for v in per.values())
            a2a *= comm.ULYSSES_PER_STEP_FACTOR / 2  # per pass (forward, backward)
        link = comm.link_for(self.hw, c.devices)
        n = c.devices
        block_numels = [self.block_numel(c.precision, name) for name in self.blocks]
        root_numel = max(0.0, sum(self.param_numels) - sum(block_numels))
        gb, rb = self.gather_bytes_per_param(c), self.reduce_bytes_per_param(c)
        if c.zero_stage >= 2:
            gather = tuple(comm.all_gather_s(x * gb, n, link) for x in block_numels)
            reduce = tuple(comm.reduce_scatter_s(x * rb, n, link) for x in block_numels)
            root_gather, root_reduce, tail_reduce = (comm.all_gather_s(root_numel * gb, n, link),
                                                     comm.reduce_scatter_s(root_numel * rb, n, link), 0.0)
        else:
            gather, root_gather = (), 0.0
            reduce = tuple(comm.all_reduce_s(x * rb, n, link) for x in block_numels)
            tail_numel = self._param_bytes("tail") / PRECISIONS[c.precision][0]
            tail_reduce = comm.all_reduce_s(tail_numel * rb, n, link)
            root_reduce = comm.all_reduce_s(max(0.0, root_numel - tail_numel) * rb, n, link)
        times = StepTimes(
            head_fwd_s=fwd_stream_s(head, ov), head_bwd_s=bwd_stream_s(head, ov),
            tail_fwd_s=fwd_stream_s(tail, ov), tail_bwd_s=bwd_stream_s(tail, ov),
            block_fwd_s=tuple(fwd_stream_s(x, ov) + a2a for x in blocks),
            block_bwd_s=tuple(bwd_stream_s(x, ov) + a2a for x in blocks),
            root_gather_s=root_gather, block_gather_s=gather, root_reduce_s=root_reduce,
            block_reduce_s=reduce, tail_reduce_s=tail_reduce)
        line = step_timeline(times, zero_stage=c.zero_stage, grad_accum=c.grad_accum)
        a2a_step = c.grad_accum * 2 * a2a * len(blocks)
        after = (comm.all_gather_s(sum(self.param_numels) * PRECISIONS[c.precision][0], n, link)
                 if c.zero_stage == 1 else 0.0)  # ZeroRedundancyOptimizer's broadcast
        return line.comm_s + a2a_step + after, line.exposed_comm_s + a2a_step + after

    def mixed_precision_policy(self, c: Choice) -> bool:
        """Whether `c` runs FSDP2 with `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`:
        bf16-mixed at ZeRO 2/3 over more than one device, as `trainplan.executor.parallel.zero.apply_zero`
        does (and torchtitan's FSDP2 setup). Parameters are all-gathered and computed in bf16
        (no autocast), gradients reduce-scattered and kept in fp32."""
        return c.precision == "bf16-mixed" and c.zero_stage >= 2 and c.devices > 1

    def gather_bytes_per_param(self, c: Choice) -> int:
        """Bytes per parameter FSDP2 all-gathers: 2 under the mixed-precision policy, else the
        parameter width."""
        return 2 if self.mixed_precision_policy(c) else PRECISIONS[c.precision][0]

    def reduce_bytes_per_param(self, c: Choice) -> int:
        """Bytes per gradient element reduced: the gradient width (fp32 under bf16-mixed, the
        policy's `reduce_dtype`)."""
        return PRECISIONS[c.precision][1]

    def block_numel(self, precision: str, name: str) -> float:
        """Parameters of block region `name` (its bytes at `precision`'s parameter width)."""
        return self._param_bytes(name) / PRECISIONS[precision][0]
