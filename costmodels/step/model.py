"""Cost of one training step for one choice of knobs: memory, FLOPs and time per device.

Composes the region lifetime simulation (`costmodels.step.memory`), per-node FLOPs (torch's
`flop_counter` formulas, captured as polynomials) and a per-node roofline over the hardware
profile (`costmodels.step.roofline`: Williams et al. 2009; efficiency curves as data, as
Calculon does, Isaev et al. 2023) and the collectives of Ulysses SP and ZeRO
(`costmodels.step.comm`). Communication is added, not overlapped with compute: a
conservative bound, stated in the Plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache

from costmodels.checkpoint_sets import CheckpointSet, resolve, saved_nodes, sets_from_mapping
from costmodels.graph import Region
from costmodels.step import comm
from costmodels.step.fsdp import FsdpLayout, root_gather_events
from costmodels.step.memory import MemoryBreakdown, RegionMemory, model_state_bytes, simulate_region, step_peak
from costmodels.step.precision import PRECISIONS
from costmodels.step.roofline import RegionCost, region_cost
from costmodels.step.ulysses import ulysses_block_events
from hardware_profiles import HardwareProfile
from trainplan_errors import TrainplanError


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

    @classmethod
    def from_decisions(cls, d) -> Choice:
        """The choice a Plan's `Decisions` (`planner.plan`) fixes, its solved entries included."""
        return cls(sp_degree=d.sp_degree, zero_stage=d.zero_stage, micro_batch=d.micro_batch,
                   seq_len=d.seq_len, policies=tuple(d.checkpoint), precision=d.precision,
                   optimizer_bits=d.optimizer_bits, devices=d.devices,
                   activation_bits=getattr(d, "activation_bits", 32),
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
    optimizer_s: float
    """Roofline seconds of the optimizer step (memory-bound)."""
    overhead_s: float
    """Per-op overhead: ops executed x the profile's `op_overhead_s`."""

    @property
    def time_s(self) -> float:
        return self.compute_s + self.recompute_s + self.comm_s + self.optimizer_s + self.overhead_s

    def breakdown(self) -> dict[str, float]:
        """Seconds per step by part; they add up to `time_s`."""
        return {"compute": self.compute_s, "recompute": self.recompute_s,
                "communication": self.comm_s, "optimizer": self.optimizer_s,
                "overhead": self.overhead_s}


class StepModel:
    """Evaluates `Choice`s for one captured model on one hardware profile, caching per-region
    results (a solver asks for many choices that share regions)."""

    def __init__(self, regions: Mapping[str, Region], blocks: tuple[str, ...], param_numels: tuple[int, ...],
                 hw: HardwareProfile, *, n_heads: int, n_kv_heads: int, head_dim: int):
        self.regions, self.blocks, self.param_numels, self.hw = regions, blocks, param_numels, hw
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self._mem = lru_cache(maxsize=None)(self._region_memory)
        self._cost = lru_cache(maxsize=None)(self._region_cost)
        self._tail_root = lru_cache(maxsize=None)(self._tail_root_memory)
        self._states = lru_cache(maxsize=None)(self._model_states)
        self._param_bytes = lru_cache(maxsize=None)(lambda name: self.regions[name].param_bytes())

    def model_states(self, c: Choice):
        """Per-device model states (`costmodels.step.memory.model_state_bytes`, as executed) at `c`'s
        precision, optimizer bits, ZeRO stage and device count."""
        return self._states(c.precision, c.optimizer_bits, c.zero_stage, c.devices)

    def _model_states(self, precision: str, optimizer_bits: int, zero_stage: int, devices: int):
        wb, gb, master, _ = PRECISIONS[precision]
        return model_state_bytes(self.param_numels, weight_bytes=wb, grad_bytes=gb, master_bytes=master,
                                 optimizer_bits=optimizer_bits, zero_stage=zero_stage,
                                 shard_degree=devices, foreach=self.hw.device_type != "cpu",
                                 as_executed=True)

    def region_name(self, name: str, activation_bits: int, policy: str | CheckpointSet = "none") -> str:
        """The captured region that runs `name` with saved activations at `activation_bits`:
        `name` itself at 32 bits or inside a checkpointed entry (torch's checkpoint hooks take
        precedence over the compression's, `modeling.activation_compression`), else the variant
        `name@a{bits}` captured under the compression.

        Raises:
            TrainplanError: the variant was not captured (capture with `activation_bits`)."""
        if activation_bits == 32 or resolve(policy).checkpointed:
            return name
        variant = f"{name}@a{activation_bits}"
        if variant not in self.regions:
            raise TrainplanError(
                f"activation_bits={activation_bits} needs the regions captured with that "
                f"compression ({variant!r} is missing): capture with activation_bits=({activation_bits},)")
        return variant

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
        Ulysses' exchanges around attention when `c.sp_degree` > 1 (`costmodels.step.ulysses`)."""
        entry = c.entry(policy)
        return self._mem(self.region_name(self.blocks[i], c.activation_bits, entry), c.micro_batch,
                         c.seq_len // c.sp_degree, entry, c.sp_degree)

    def block_cost(self, c: Choice, i: int, policy: str | CheckpointSet) -> RegionCost:
        """FLOPs and roofline seconds of block i under entry `policy` at `c`'s shape."""
        entry = c.entry(policy)
        return self._cost(self.region_name(self.blocks[i], c.activation_bits, entry), c.micro_batch,
                          c.seq_len // c.sp_degree, c.sp_degree, entry, PRECISIONS[c.precision][3])

    def block_time(self, c: Choice, i: int, policy: str | CheckpointSet) -> float:
        """Seconds of block i per step: forward, backward, recompute and per-op overhead."""
        x = self.block_cost(c, i, policy)
        return x.fwd_s + x.bwd_s + x.recompute_s + x.n_ops * self.hw.op_overhead_s

    def evaluate(self, c: Choice) -> StepCost:
        """Memory, FLOPs and time of one step under `c`, per device."""
        fsdp = self.fsdp_layout(c)
        states = self.model_states(c)
        head = self.head_memory(c)
        tail = self.tail_memory(c)
        blocks = [self.block_memory(c, i, p) for i, p in enumerate(c.policies)]
        memory = step_peak(head, blocks, tail, states, fsdp=fsdp)
        return self._with_runtime(c, memory)

    def tail_memory(self, c: Choice) -> RegionMemory:
        """Lifetime summary of the tail (final norm, LM head, loss) at `c`'s shape; with ZeRO-3
        over more than one device it includes FSDP2's root group, resharded during the loss
        and all-gathered again for the backward (`costmodels.step.fsdp.root_gather_events`)."""
        b, s = c.micro_batch, c.seq_len // c.sp_degree
        fsdp = self.fsdp_layout(c)
        name = self.region_name("tail", c.activation_bits)
        if fsdp is not None and fsdp.reshard_after_forward:
            return self._tail_root(name, b, s, fsdp.root_param_bytes)
        return self._mem(name, b, s, "none")

    def head_memory(self, c: Choice) -> RegionMemory:
        """Lifetime summary of the head (embedding, rotary tables) at `c`'s shape."""
        return self._mem(self.region_name("head", c.activation_bits), c.micro_batch,
                         c.seq_len // c.sp_degree, "none")

    def fsdp_layout(self, c: Choice) -> FsdpLayout | None:
        """FSDP2's all-gathered groups at `c` (ZeRO 2/3 over more than one device), else None.
        The root group's bytes are all parameters' bytes at the weight width less the blocks'
        (captured at the parameter dtype, which FSDP2 gathers without a mixed-precision policy)."""
        if c.zero_stage < 2 or c.devices == 1:
            return None
        blocks = tuple(self._param_bytes(name) for name in self.blocks)
        whole = sum(self.param_numels) * PRECISIONS[c.precision][0]
        return FsdpLayout(root_param_bytes=max(0.0, whole - sum(blocks)), block_param_bytes=blocks,
                          shard_degree=c.devices, reshard_after_forward=c.zero_stage == 3,
                          reduce_scatter_copy=self.hw.device_type == "cpu")

    def runtime(self, c: Choice) -> StepCost:
        """FLOPs and time of one step under `c`, without the memory replay (its `memory` is an
        empty breakdown with phase `not evaluated`): what a solver needs per candidate."""
        return self._with_runtime(c, MemoryBreakdown(phase="not evaluated"))

    def _with_runtime(self, c: Choice, memory: MemoryBreakdown) -> StepCost:
        b, s, sp = c.micro_batch, c.seq_len // c.sp_degree, c.sp_degree
        dtype = PRECISIONS[c.precision][3]
        costs = [self._cost(self.region_name(r, c.activation_bits), b, s, sp, "none", dtype)
                 for r in ("head", "tail")]
        costs += [self.block_cost(c, i, p) for i, p in enumerate(c.policies)]
        model_flops = sum(x.fwd_flops + x.bwd_flops for x in costs)
        recompute_flops = sum(x.recompute_flops for x in costs)
        compute_s = sum(x.fwd_s + x.bwd_s for x in costs)
        recompute_s = sum(x.recompute_s for x in costs)
        opt_bytes, opt_ops = self.optimizer_traffic(c)
        hw = self.hw
        return StepCost(memory=memory, flops=model_flops + recompute_flops, model_flops=model_flops,
                        compute_s=compute_s, recompute_s=recompute_s, comm_s=self.comm_s(c),
                        optimizer_s=self.optimizer_s(c, opt_bytes),
                        overhead_s=(sum(x.n_ops for x in costs) + opt_ops) * hw.op_overhead_s)

    def optimizer_s(self, c: Choice, traffic_bytes: float) -> float:
        """Seconds of one optimizer step on this device: the profile's measured seconds per
        parameter for these bits (`HardwareProfile.optimizer_s_per_param`, the cpu profile's
        probe) times this device's share of the parameters, else the roofline of its traffic
        (`optimizer_traffic`) at the profile's memory bandwidth."""
        measured = self.hw.optimizer_s_per_param.get(str(c.optimizer_bits))
        if measured is not None:
            shard = c.devices if c.zero_stage >= 1 else 1
            return measured * sum(self.param_numels) / shard
        return traffic_bytes / (self.hw.hbm_bandwidth_bytes_per_s * self.hw.memory_efficiency)

    def optimizer_traffic(self, c: Choice) -> tuple[float, int]:
        """(bytes moved, ops) of one AdamW step on this device's share of the parameters.

        32-bit AdamW (torch, per tensor): reads parameter, gradient, both moments and writes
        parameter and moments, plus two fp32 temporaries written and read (sqrt and its
        quotient): 11 fp32 passes, ~12 ops per tensor; 16-bit: the same over pure-bf16
        parameters, in bf16. 8/4-bit (bitsandbytes, torchao compiled): one fused kernel per
        tensor reading parameter and gradient, reading and writing the quantized moments."""
        shard = c.devices if c.zero_stage >= 1 else 1
        n = sum(self.param_numels) / shard
        tensors = len(self.param_numels)
        if c.optimizer_bits in (32, 16):  # torch AdamW in the parameter dtype (fp32 or bf16)
            return 11 * c.optimizer_bits / 8 * n, 12 * tensors
        q = c.optimizer_bits / 8
        return (3 * 4 + 4 * q) * n, 2 * tensors

    def unsharded_bytes(self, c: Choice) -> float:
        """Parameters FSDP (ZeRO-3) holds all-gathered during a block's forward or backward
        beyond the root group (`fsdp_layout`): the block's whole parameters and its all-gather
        buffer (forward) or the next block's, prefetched (backward)."""
        if c.zero_stage != 3 or c.devices == 1:
            return 0.0
        return 2 * self._param_bytes(self.blocks[0])  # captured at the parameter dtype

    def link(self, group: int) -> comm.Link:
        hw = self.hw
        inter = group > hw.devices_per_node
        return comm.Link(
            bandwidth_bytes_per_s=hw.inter_node_bandwidth_bytes_per_s if inter else hw.intra_node_bandwidth_bytes_per_s,
            latency_s=hw.inter_node_latency_s if inter else hw.intra_node_latency_s,
            efficiency=hw.network_efficiency)

    def comm_s(self, c: Choice) -> float:
        """Seconds per step of Ulysses all-to-alls (SP group kept inside a node when it fits)
        and ZeRO collectives over all devices."""
        if c.devices == 1:
            return 0.0
        wb, gb, _, _ = PRECISIONS[c.precision]
        t = 0.0
        if c.sp_degree > 1:
            per = comm.ulysses_all_to_all_bytes(
                micro_batch=c.micro_batch, seq_len=c.seq_len, n_heads=self.n_heads,
                n_kv_heads=self.n_kv_heads, head_dim=self.head_dim, sp_degree=c.sp_degree,
                bytes_per_element=wb)
            link = self.link(c.sp_degree)
            one = sum(comm.all_to_all_s(v, c.sp_degree, link) for v in per.values())
            t += comm.ULYSSES_PER_STEP_FACTOR * one * len(self.blocks)
        coll = comm.zero_comm_bytes(sum(self.param_numels), stage=c.zero_stage, dp_degree=c.devices,
                                    grad_bytes_per_param=gb, param_bytes_per_param=wb)
        link = self.link(c.devices)
        t += sum(x.time_s(link) for x in coll.values())
        return t
