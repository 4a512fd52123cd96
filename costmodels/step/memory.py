"""Per-device memory of one training step: model states plus a tensor-lifetime simulation.

Model states follow the ZeRO accounting (Rajbhandari et al. 2020, Sec. 3.1 and Fig. 1): with
mixed-precision Adam a parameter costs 2 (bf16 weight) + 2 (bf16 grad) + 12 (fp32 master, m, v) = 16
bytes, and stages 1/2/3 shard the optimizer states / gradients / parameters over the data-parallel x
SP group; as the executor runs them (`model_state_bytes(as_executed=True)`) stage 1 shards whole
tensors and stages 2/3 are FSDP2, whose all-gathered parameters and reduce-scatter buffers come from
`trainplan.costmodels.step.fsdp`. Activations are not a sum of saved sizes: each captured region is replayed
op by op, a storage alive from the op that makes it to the last op that reads it (views share their
base's storage), and regions compose in execution order (head, blocks, tail, blocks backward, head
backward). With a checkpointed block, only the block input and the outputs of ops the policy saves
survive its forward; at the start of its backward the forward is replayed (recompute) before the
backward ops.

What is counted: tensor bytes as `torch.distributed._tools.mem_tracker.MemTracker` counts them
(parameters, gradients, optimizer states, activations, temporaries). Not counted: allocator
rounding and fragmentation, the CUDA/ROCm context, communication buffers: the hardware
profile's `memory_reserve_bytes` stands for those.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, fields
from functools import lru_cache

from trainplan.costmodels.graph import Region, poly_at
from trainplan.costmodels.step.fsdp import FsdpLayout
from trainplan.costmodels.step.optimizer_states import (
    MIN_QUANT_NUMEL,
    TORCHAO_EAGER_STEP_COPIES,
    adam_state_bytes,
    adamw_step_temp_bytes,
    quantization_map_bytes,
)
from trainplan.errors import TrainplanError

CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries")

@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBreakdown:
    """Bytes per device by category at one moment (the predicted peak); they add up."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    """Tensors made in forward and alive at the moment (MemTracker's ACT)."""
    temporaries: float = 0.0
    """Tensors made in backward outside recompute (MemTracker's TEMP; it labels what the
    recompute of a checkpointed block makes ACT, and so does this model)."""
    phase: str = ""
    """Where in the step the peak falls, e.g. `bwd:block3`, `tail`, `optimizer`."""

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.temporaries

    def __add__(self, other: MemoryBreakdown) -> MemoryBreakdown:
        return MemoryBreakdown(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                                  for f in fields(self) if f.name != "phase"},
                               phase=self.phase or other.phase)

    def as_dict(self) -> dict[str, float]:
        return {c: getattr(self, c) for c in CATEGORIES} | {"total": self.total}


@dataclass(frozen=True, kw_only=True, slots=True)
class RegionMemory:
    """Lifetime summary of one region at one (micro-batch, sequence, policy)."""

    fwd_peak: MemoryBreakdown
    """Highest live bytes during the region's forward (its input included)."""
    retained: float
    """Bytes the region holds from the end of its forward until its backward (its input if
    backward needs it, and saved activations; not its forward output)."""
    bwd_peak: MemoryBreakdown
    """Highest live bytes during its backward (recompute, retained, incoming gradient,
    temporaries and the parameter gradients made so far)."""
    grad_bytes: float
    bwd_peak_accumulating: MemoryBreakdown = MemoryBreakdown()
    """`bwd_peak` when the parameters already hold gradients (gradient accumulation, from the
    second micro-step on): autograd's AccumulateGrad adds each new gradient into `.grad` in
    place (`variable_grad += new_grad`, `torch/csrc/autograd/functions/accumulate_grad.h`), so
    a gradient is a temporary until it is added, and none is made for good."""
    input_bytes: float = 0.0
    """Bytes of the hidden states handed in (the region's activation input): what a checkpointed
    block keeps of its forward beyond its saved outputs, and what activation offload moves to
    host memory (`trainplan.costmodels.step.model.StepModel.block_memory`)."""
    offloaded_bytes: float = 0.0
    """Bytes held in host memory from the forward to the backward (activation offload), not on
    the device; 0 without offload."""
    handed: tuple[float, ...] = ()
    """The head: bytes of each tensor it hands the blocks besides the hidden states (rotary
    tables, masks, position ids; `Region.handed`), not in `retained`."""


def simulate_region(region: Region, b: int, s: int, *, checkpoint: bool = False,
                    saved_ops: Iterable[str] = (),
                    extra: Iterable[tuple[float, float, float, str]] = ()) -> RegionMemory:
    """Replay `region`'s storages at micro-batch `b` and per-rank sequence `s`.

    `checkpoint=False`: plain autograd (everything backward needs is kept). `checkpoint=True`:
    selective activation checkpointing keeping the outputs of `saved_ops` (FX node names) and
    the region's inputs; everything else is freed after its last forward use and recomputed
    at the start of the backward. `saved_ops=()` with `checkpoint=True` is full checkpointing.
    `extra`: more storages as (made at, freed at, bytes, `act`|`temp`|`grad`|`param`), times on
    the region's execution indices (e.g. `trainplan.costmodels.step.fsdp.root_gather_events`).
    """
    saved = frozenset(saved_ops)
    bnd = region.boundary
    n = region.n_nodes
    bwd_start = bnd + 0.5
    horizon = region.recompute_horizon()

    def t_re(k: int) -> float:  # when the recompute at the start of backward replays node k
        return bnd + 0.5 + 0.4 * (k + 1) / (bnd + 2)

    # (time, 0 alloc | 1 free, bytes, category, micro-step); at one time allocations come first
    events: list[tuple[float, int, float, str, int]] = []

    def live(t0: float, t1: float, nbytes: float, cat: str, when: int = BOTH) -> None:
        events.extend([(t0, 0, nbytes, cat, when), (t1, 1, nbytes, cat, when)])

    for r in region.storages:
        if r.category == "param" or r.input_kind in ("shared", "const"):
            continue
        nbytes = poly_at(r.bytes, b, s)
        if nbytes == 0:
            continue
        last = r.last_use if r.last_use < n else n - 0.25  # region outputs live to its end
        if r.is_fwd_output:  # handed to the next region, which accounts for it from then on
            live(r.created, bnd, nbytes, "act")
        elif r.input_kind == "grad":
            live(bwd_start, last, nbytes, "temp")
        elif r.category == "input":  # hidden states handed in
            end = last if r.last_use > bnd else r.last_fwd_use
            live(0, max(end, bwd_start) if checkpoint else end, nbytes, "act")
        elif r.category == "grad":  # made as a temporary, then moved into .grad, or copied
            if r.copied_on_accumulate:  # when its layout differs: both exist for a moment
                live(r.created, r.created + 0.02, nbytes, "temp", FIRST)
                live(r.created + 0.01, last, nbytes, "grad", FIRST)
            else:
                live(r.created, r.created + 0.01, nbytes, "temp", FIRST)
                live(r.created + 0.02, last, nbytes, "grad", FIRST)
            # added into .grad in place; MemTracker's tensor hook on the parameter labels it GRAD
            live(r.created, r.created + 0.01, nbytes, "grad", ACCUMULATING)
        elif r.category == "temp" or not checkpoint:
            live(r.created, last, nbytes, r.category)
        elif r.creator in saved:  # kept by the checkpoint's cache until the recompute
            live(r.created, last if r.last_use > bnd else t_re(r.created), nbytes, "act")
        else:  # freed after its last forward use, made again by the recompute
            live(r.created, r.last_fwd_use, nbytes, "act")
            if r.created <= horizon:
                live(t_re(r.created), last if r.last_use > bnd else t_re(min(r.last_fwd_use, horizon)),
                     nbytes, "act")
    for t0, t1, nbytes, cat in extra:
        live(t0, t1, nbytes, cat)
    events.sort(key=lambda e: (e[0], e[1]))
    fwd_peak, retained, bwd_peak = _sweep(events, bnd, skip=ACCUMULATING)
    _, _, bwd_accumulating = _sweep(events, bnd, skip=FIRST)
    inputs = sum(poly_at(r.bytes, b, s) for r in region.storages if r.category == "input" and r.input_kind == "act")
    return RegionMemory(fwd_peak=fwd_peak, retained=retained, bwd_peak=bwd_peak,
                        grad_bytes=region.param_grad_bytes(b, s), bwd_peak_accumulating=bwd_accumulating,
                        input_bytes=inputs, handed=tuple(poly_at(p, b, s) for p in region.handed))


BOTH, FIRST, ACCUMULATING = 0, 1, 2
"""Which micro-steps a storage of `simulate_region` lives in: all, the first of an optimizer
step (no `.grad` yet), or those that accumulate into `.grad`."""


def _sweep(events: list[tuple[float, int, float, str, int]], bnd: int,
           skip: int) -> tuple[MemoryBreakdown, float, MemoryBreakdown]:
    """(forward peak, retained, backward peak) of sorted `events`, leaving out those of `skip`."""
    alive = {"act": 0.0, "temp": 0.0, "grad": 0.0, "param": 0.0}  # bytes alive by category
    fwd_peak = bwd_peak = MemoryBreakdown()
    retained = 0.0
    for t, kind, nbytes, cat, when in events:
        if when == skip:
            continue
        alive[cat] += nbytes if kind == 0 else -nbytes
        if kind == 0:
            snap = MemoryBreakdown(activations=alive["act"], temporaries=alive["temp"], grads=alive["grad"],
                                   params=alive["param"])
            if t <= bnd and snap.total > fwd_peak.total:
                fwd_peak = snap
            elif t > bnd and snap.total > bwd_peak.total:
                bwd_peak = snap
        if t <= bnd:
            retained = alive["act"] + alive["temp"]
    return fwd_peak, retained, bwd_peak


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelStates:
    """Per-device bytes of parameters, gradients and optimizer states."""

    params: float
    """Parameters a device holds at rest (at the optimizer step): sharded with ZeRO-3, and with
    ZeRO-2 as FSDP2 runs it (`as_executed`); what FSDP2 all-gathers on top is `FsdpLayout`'s."""
    grads: float
    optimizer: float
    optimizer_step_temp: float
    """Scratch the optimizer step allocates (see `model_state_bytes`)."""
    grad_scale: float = 1.0
    """Share of a gradient a device keeps once its block's backward is done: 1/shard_degree
    with ZeRO 2/3 (FSDP reduce-scatters each block's gradients), else 1."""
    comm_buffers: float = 0.0
    """DDP's gradient buckets: one flat copy of all gradients
    (`torch.nn.parallel.DistributedDataParallel`, default `gradient_as_bucket_view=False`),
    allocated when DDP rebuilds its buckets after the first step and kept; counted from the
    start of the backward (`step_phases`), as temporaries, as MemTracker labels them."""


def zero1_partition(numels: list[int], shard_degree: int) -> list[int]:
    """Indices into `numels` of the tensors the most loaded rank steps under ZeRO-1.

    torch's `ZeroRedundancyOptimizer._partition_parameters` (torch 2.13,
    `torch/distributed/optim/zero_redundancy_optimizer.py`) assigns whole tensors, largest
    first, each to the rank with the fewest elements so far (the lowest rank on ties); ranks
    differ by up to one tensor, and the per-device peak is that of the largest share."""
    return list(_zero1_partition(tuple(numels), shard_degree))


@lru_cache(maxsize=64)
def _zero1_partition(numels: tuple[int, ...], shard_degree: int) -> tuple[int, ...]:
    if not numels:
        return ()
    heap = [(0, r) for r in range(shard_degree)]  # (elements so far, rank): a min-heap
    owned: list[list[int]] = [[] for _ in range(shard_degree)]
    for i in sorted(range(len(numels)), key=lambda k: numels[k], reverse=True):
        size, r = heapq.heappop(heap)
        owned[r].append(i)
        heapq.heappush(heap, (size + numels[i], r))
    sizes = [sum(numels[i] for i in o) for o in owned]
    return tuple(owned[sizes.index(max(sizes))])


def model_state_bytes(param_numels: Iterable[int], *, weight_bytes: int, grad_bytes: int,
                      master_bytes: int, optimizer_bits: int, zero_stage: int, shard_degree: int,
                      adamw: str = "fused", as_executed: bool = False) -> ModelStates:
    """Model-state bytes per device (ZeRO, Rajbhandari et al. 2020, Sec. 5: stage 1 shards
    optimizer states, 2 adds gradients, 3 adds parameters, over `shard_degree` ranks).

    `master_bytes` is 4 for bf16 mixed precision (an fp32 master copy, counted with the
    optimizer states as ZeRO does) and 0 otherwise. `as_executed=False` is the paper's
    accounting (elementwise shards, stage-2 parameters replicated); `True` the stages as
    `trainplan.executor.parallel.zero.apply_zero` runs them with torch: stage 1's `ZeroRedundancyOptimizer`
    shards whole tensors (`zero1_partition`: the largest rank share is counted), stage 2's FSDP2
    (`fully_shard`, `reshard_after_forward=False`) keeps parameters sharded at rest and
    all-gathers them from forward to backward (`FsdpLayout`, not counted here).

    Raises:
        TrainplanError: zero_stage not in 0..3 or shard_degree < 1.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise TrainplanError(f"zero_stage={zero_stage} is not valid: use 0, 1, 2 or 3")
    if shard_degree < 1:
        raise TrainplanError(f"shard_degree={shard_degree} must be at least 1")
    numels = list(param_numels)
    total = sum(numels)
    d = shard_degree

    def opt_bytes(ns: list[int]) -> float:
        b = sum(adam_state_bytes(n, optimizer_bits, weight_bytes) for n in ns) + master_bytes * sum(ns)
        return b + (quantization_map_bytes(optimizer_bits) if any(n >= MIN_QUANT_NUMEL for n in ns) else 0.0)
    opt_numel: float  # optimizer-state elements on this device
    if zero_stage == 1 and d > 1 and as_executed:
        mine = [numels[i] for i in zero1_partition(numels, d)]
        optimizer, opt_numel = opt_bytes(mine), sum(mine)
    else:
        optimizer = opt_bytes(numels) / (d if zero_stage >= 1 else 1)
        opt_numel = total / (d if zero_stage >= 1 else 1)
    params = total * weight_bytes / (d if zero_stage >= 3 or (as_executed and zero_stage == 2) else 1)
    grads = total * grad_bytes / (d if zero_stage >= 2 else 1)
    # Adam's step scratch, labelled optimizer state by MemTracker (`adamw_step_temp_bytes`);
    # bitsandbytes' 8-bit kernels update in place; torchao's 4-bit update, run eagerly, holds
    # `TORCHAO_EAGER_STEP_COPIES` fp32 copies of the tensor being updated.
    largest = max((-(-n // d) if zero_stage >= 2 else n for n in numels), default=0)
    if optimizer_bits == 8:
        step_temp = 0.0
    elif optimizer_bits == 4:
        step_temp = (TORCHAO_EAGER_STEP_COPIES + (weight_bytes < 4)) * 4 * largest
    else:  # torch AdamW: states in the parameter dtype
        step_temp = adamw_step_temp_bytes(adamw, state_bytes=weight_bytes, largest_numel=largest,
                                          local_numel=opt_numel)
    buckets = total * grad_bytes if zero_stage <= 1 and shard_degree > 1 else 0.0
    return ModelStates(params=params, grads=grads, optimizer=optimizer, optimizer_step_temp=step_temp,
                       grad_scale=1.0 / d if zero_stage >= 2 else 1.0, comm_buffers=buckets)


def step_peak(head: RegionMemory, blocks: list[RegionMemory], tail: RegionMemory,
              states: ModelStates, *, unsharded_block_param_bytes: float = 0.0,
              fsdp: FsdpLayout | None = None, held_grad_bytes: float = 0.0) -> MemoryBreakdown:
    """Peak bytes per device over one training step, and the category split at that moment:
    the largest of `step_phases`."""
    return max(step_phases(head, blocks, tail, states,
                           unsharded_block_param_bytes=unsharded_block_param_bytes, fsdp=fsdp,
                           held_grad_bytes=held_grad_bytes),
               key=lambda m: m.total)


def step_phases(head: RegionMemory, blocks: list[RegionMemory], tail: RegionMemory,
                states: ModelStates, *, unsharded_block_param_bytes: float = 0.0,
                fsdp: FsdpLayout | None = None, held_grad_bytes: float = 0.0) -> list[MemoryBreakdown]:
    """The highest bytes per device of each phase of one training step, in execution order.

    Composes region summaries in execution order: head forward; block i forward with the
    retained bytes of the head and blocks before it; the tail (logits and loss, forward and
    backward) with everything retained; block i backward with the gradients of the later
    blocks (sharded by `states.grad_scale` once their block is done); the head backward; then the
    optimizer step. `unsharded_block_param_bytes` adds all-gathered parameters during a block's
    forward and backward; `fsdp` (ZeRO 2/3 under FSDP2) replaces it with `FsdpLayout`'s
    all-gathered parameters per phase, keeps the root group's gradients whole until its
    reduce-scatter at the end of the backward, and adds the reduce-scatters' buffers.

    `held_grad_bytes` > 0 (gradient accumulation: `ModelStates.grads`, whole under DDP's
    `no_sync`, sharded under FSDP2): the first micro-step's phases as above (no gradients yet:
    the optimizer step before it set them to None), then a later micro-step's, the gradients
    held in every phase and the new ones added into them in place (`_micro_step_phases`), not
    counted again.
    """
    u = unsharded_block_param_bytes
    phases = _micro_step_phases(head, blocks, tail, states, u, fsdp, held_grad_bytes=0.0)
    if held_grad_bytes:
        phases += _micro_step_phases(head, blocks, tail, states, u, fsdp, held_grad_bytes=held_grad_bytes)
    phases.append(MemoryBreakdown(params=states.params, grads=states.grads, optimizer=states.optimizer,
                                  temporaries=states.comm_buffers, phase="optimizer")
                  + MemoryBreakdown(optimizer=states.optimizer_step_temp))
    return phases


def _micro_step_phases(head: RegionMemory, blocks: list[RegionMemory], tail: RegionMemory,
                       states: ModelStates, unsharded_block_param_bytes: float, fsdp: FsdpLayout | None,
                       *, held_grad_bytes: float) -> list[MemoryBreakdown]:
    """The phases of one micro-step's forward and backward (`step_phases`). With
    `held_grad_bytes` > 0 the parameters hold gradients from earlier micro-steps: without FSDP2
    every new gradient is added into its `.grad` in place (`RegionMemory.bwd_peak_accumulating`),
    so no region's gradients are kept on top; under FSDP2 the unsharded parameters' gradients
    are made anew each micro-step (the regions' `bwd_peak`; the root group's stay whole until its
    reduce-scatter) and each block's reduce-scattered shard is added into the held shard."""
    accumulating = held_grad_bytes > 0
    base = MemoryBreakdown(params=states.params, optimizer=states.optimizer, grads=held_grad_bytes)
    n = len(blocks)
    if fsdp is None:
        u_head = u_tail = u_end = 0.0
        u_fwd = u_bwd = [unsharded_block_param_bytes] * n
        root_scale = 0.0 if accumulating else states.grad_scale
    else:
        u_head, u_fwd, u_tail, u_bwd, u_end = fsdp.unsharded(n)
        root_scale = 1.0
    block_scale = 0.0 if accumulating else states.grad_scale

    def bwd_peak(m: RegionMemory) -> MemoryBreakdown:
        return m.bwd_peak_accumulating if accumulating and fsdp is None else m.bwd_peak

    # DDP's buckets (one flat copy of the gradients) are written from the end of the tail's
    # backward on (after its peak, the logits' gradient):
    # the first bucket holds the LM head's gradient alone (DDP's first bucket is 1 MiB), the next
    # opens with the final norm's, which arrives right after it, so from the blocks' backward on
    # MemTracker sees (nearly) all of them (`_MemRefType.TEMP`, measured op by op on the 2-rank
    # runs of tests/integration/test_parallel.py). On a device they persist between steps and are
    # in the forward too: up to one more gradient copy under DDP that this model does not count.
    bucket_bytes = states.comm_buffers
    candidates: list[MemoryBreakdown] = []

    def at(phase: str, retained: float, grads: float, transient: MemoryBreakdown, extra: float = 0.0):
        candidates.append(base + transient + MemoryBreakdown(
            activations=retained, grads=grads, params=extra, phase=phase))

    at("fwd:head", 0.0, 0.0, head.fwd_peak, u_head)
    # + what the head hands the blocks (rotary tables, masks), kept by blocks that save it or are
    # checkpointed: to block 0's backward (an upper bound where nothing keeps one, e.g. an eager mask)
    acc = head.retained + sum(head.handed)
    prefix = [acc]
    for i, blk in enumerate(blocks):
        at(f"fwd:block{i}", acc, 0.0, blk.fwd_peak, u_fwd[i])
        acc += blk.retained
        prefix.append(acc)
    at("tail", acc, 0.0, tail.fwd_peak, u_tail)
    grads = 0.0
    at("tail", acc, grads, bwd_peak(tail), u_tail)  # its peak (the logits' gradient) is before any bucket
    grads += tail.grad_bytes * root_scale
    for i in reversed(range(n)):
        g = blocks[i].grad_bytes
        at(f"bwd:block{i}", prefix[i], grads, bwd_peak(blocks[i]) + MemoryBreakdown(
            temporaries=bucket_bytes), u_bwd[i])
        if fsdp is not None:  # its reduce-scatter, once its backward is done
            at(f"bwd:block{i}", prefix[i], grads, MemoryBreakdown(temporaries=fsdp.reduce_bytes(g)),
               fsdp.at_reduce(n)[i])  # resharded before its reduce-scatter
        grads += g * block_scale
    at("bwd:head", 0.0, grads, bwd_peak(head) + MemoryBreakdown(temporaries=bucket_bytes), u_end)
    if fsdp is not None:  # the root group's reduce-scatter in the backward's final callback; the
        # head's gradients, the last made, are still referenced then (measured: one whole copy)
        root = tail.grad_bytes + head.grad_bytes
        at("bwd:root", 0.0, grads - tail.grad_bytes, MemoryBreakdown(
            temporaries=head.grad_bytes + fsdp.reduce_bytes(root)))
    return candidates
