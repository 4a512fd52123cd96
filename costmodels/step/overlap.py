"""Exposed communication: compute and collectives on two streams, as the executor issues them.

A step is a program of compute phases (a region's forward, a block's backward, ...) run in order
on the compute stream, and of collectives issued between them onto one communication stream,
where they run in issue order (NCCL/RCCL serialize collectives of one communicator; FSDP2
issues its all-gathers and reduce-scatters on side streams, `torch/distributed/fsdp/_fully_shard/
_fsdp_param_group.py`). A phase waits for the collectives it needs (a block's all-gathered
parameters); a collective starts once it is issued and the stream is free. The step ends when
both streams are done (the optimizer step waits for the last reduce-scatter). Exposed
communication is what the step takes beyond its compute: collectives hidden behind compute cost
nothing, the rest is on the critical path. This is the overlap model of Calculon (Isaev et al.
2023, "Calculon: a methodology and tool for high-level co-design of systems and large language
models", SC23, Sec. 3: per-block communication overlapped with the block's compute, the
remainder exposed), applied to the schedule below.

The schedule as each ZeRO stage runs (`trainplan.executor.parallel.zero.apply_zero`):

- FSDP2 (ZeRO 2/3; torch 2.13 `torch/distributed/fsdp/_fully_shard/`, and torchtitan's FSDP2
  notes): the root group is all-gathered before the head runs; block i+1's
  all-gather is issued when block i starts (forward prefetch: the CPU runs ahead of the device and
  the all-gather stream lets one group run ahead); in the backward, block i-1's all-gather is
  prefetched when block i's backward starts (`_backward_prefetch`, one group) and block i's
  gradients are reduce-scattered once its backward is done (`post_backward`), behind block i-1's
  backward. The first all-gather and the last reduce-scatter (the root group's, in the backward's
  final callback) are exposed. ZeRO-3 re-gathers the blocks (and the root, which
  `apply_zero` reshards too) for the backward; ZeRO-2 does not.
- DDP (ZeRO 0/1; `torch.nn.parallel.DistributedDataParallel`, Li et al. 2020, "PyTorch
  Distributed: experiences on accelerating data parallel training", VLDB, Sec. 3.2.3): gradient
  buckets are all-reduced as soon as they are full, during the backward; a block's gradients are
  one bucket here (the default `bucket_cap_mb=25` groups smaller tensors, a block is one or a
  few buckets at the sizes planned), issued when its backward is done; the last bucket (the
  head's) is exposed. ZeRO-1's `ZeroRedundancyOptimizer` broadcasts the updated parameters
  after the optimizer step: exposed.
- Ulysses all-to-alls (Jacobs et al. 2023, Sec. 3) are inside attention: their time is part of
  the block's compute phase (on the critical path), not of the overlapped stream.
- Gradient accumulation: FSDP2 gathers and reduce-scatters in every micro-step (`apply_zero`
  keeps the default, gradients reduced each micro-step); DDP all-reduces only in the last
  micro-step (`no_sync` before).

Not modelled: the slowdown of compute kernels by concurrent NCCL kernels (they share SMs and
HBM), and host-side stalls. `overlap=False` in `StepModel` keeps the no-overlap sum as a
conservative bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trainplan.errors import TrainplanError


@dataclass(frozen=True, kw_only=True, slots=True)
class Phase:
    """One compute phase and the collectives issued around it."""

    name: str
    compute_s: float
    """Seconds on the compute stream."""
    waits: tuple[str, ...] = ()
    """Collectives (by name) that must be done before the phase starts."""
    issue_before: tuple[tuple[str, float], ...] = ()
    """(name, seconds) of collectives issued when the program reaches the phase, before it runs."""
    issue_after: tuple[tuple[str, float], ...] = ()
    """(name, seconds) issued once the phase's compute is done."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Timeline:
    """When a program of phases ends."""

    step_s: float
    """End of the last compute phase or collective, seconds."""
    compute_s: float
    """Sum of the compute phases, seconds."""
    comm_s: float
    """Sum of the collectives' durations, seconds (what a no-overlap model adds)."""

    @property
    def exposed_comm_s(self) -> float:
        """step_s - compute_s: communication on the critical path, seconds."""
        return max(0.0, self.step_s - self.compute_s)


def schedule(phases: Sequence[Phase]) -> Timeline:
    """Run `phases` on one compute and one communication stream (module docstring).

    A collective issued before a phase is issued when the previous phase ends (the host has
    reached it); one issued after a phase, when that phase ends. It starts at max(issue time,
    communication stream free).

    Raises:
        TrainplanError: a phase waits for a collective not issued before it, or a negative time.
    """
    t_compute = t_comm = 0.0
    done: dict[str, float] = {}
    compute = comm = 0.0

    def issue(items: tuple[tuple[str, float], ...]) -> None:
        nonlocal t_comm, comm
        for name, seconds in items:
            if seconds < 0:
                raise TrainplanError(f"collective {name!r} has negative time {seconds!r} s")
            t_comm = max(t_compute, t_comm) + seconds
            done[name] = t_comm
            comm += seconds

    for ph in phases:
        if ph.compute_s < 0:
            raise TrainplanError(f"phase {ph.name!r} has negative time {ph.compute_s!r} s")
        issue(ph.issue_before)
        missing = [w for w in ph.waits if w not in done]
        if missing:
            raise TrainplanError(f"phase {ph.name!r} waits for {missing} that no phase before it issues")
        t_compute = max([t_compute, *(done[w] for w in ph.waits)]) + ph.compute_s
        compute += ph.compute_s
        issue(ph.issue_after)
    return Timeline(step_s=max(t_compute, t_comm), compute_s=compute, comm_s=comm)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTimes:
    """Seconds of one micro-step's compute phases and of its collectives, per device."""

    head_fwd_s: float
    head_bwd_s: float
    tail_fwd_s: float
    tail_bwd_s: float
    block_fwd_s: tuple[float, ...]
    """Each block's forward (Ulysses all-to-alls included), in execution order."""
    block_bwd_s: tuple[float, ...]
    """Each block's backward, its recompute and all-to-alls included."""
    root_gather_s: float = 0.0
    """All-gather of the root group (parameters outside the blocks), FSDP."""
    block_gather_s: tuple[float, ...] = ()
    """All-gather of each block's parameters, FSDP (empty otherwise)."""
    root_reduce_s: float = 0.0
    """Reduce-scatter (FSDP) of the root group's gradients (the head's and the tail's), or
    all-reduce (DDP) of the head's."""
    tail_reduce_s: float = 0.0
    """All-reduce of the tail's gradients (DDP: their bucket is ready once the tail's backward
    is done)."""
    block_reduce_s: tuple[float, ...] = ()
    """Reduce-scatter (FSDP) or all-reduce (DDP) of each block's gradients."""


def fsdp_program(t: StepTimes, *, reshard_after_forward: bool) -> list[Phase]:
    """One micro-step under FSDP2 (ZeRO-3 with `reshard_after_forward`, else ZeRO-2)."""
    n = len(t.block_fwd_s)
    ag = t.block_gather_s
    rs = t.block_reduce_s
    if len(ag) != n or len(rs) != n or len(t.block_bwd_s) != n:
        raise TrainplanError(f"FSDP program needs {n} block gathers, reduces and backwards; got "
                             f"{len(ag)}, {len(rs)}, {len(t.block_bwd_s)}")
    first = (("ag:b0", ag[0]),) if n else ()
    p = [Phase(name="fwd:head", compute_s=t.head_fwd_s, waits=("ag:root",),
               issue_before=(("ag:root", t.root_gather_s), *first))]
    for i in range(n):
        nxt = ((f"ag:b{i + 1}", ag[i + 1]),) if i + 1 < n else ()
        p.append(Phase(name=f"fwd:block{i}", compute_s=t.block_fwd_s[i], waits=(f"ag:b{i}",), issue_before=nxt))
    tail_issue: tuple[tuple[str, float], ...] = ()
    tail_waits: tuple[str, ...] = ()
    if reshard_after_forward:
        tail_issue = (("agb:root", t.root_gather_s),) + (((f"agb:b{n - 1}", ag[n - 1]),) if n else ())
        tail_waits = ("agb:root",)
    p.append(Phase(name="tail", compute_s=t.tail_fwd_s + t.tail_bwd_s, waits=tail_waits, issue_before=tail_issue))
    for i in reversed(range(n)):
        waits = (f"agb:b{i}",) if reshard_after_forward else ()
        prefetch = ((f"agb:b{i - 1}", ag[i - 1]),) if reshard_after_forward and i > 0 else ()
        p.append(Phase(name=f"bwd:block{i}", compute_s=t.block_bwd_s[i], waits=waits, issue_before=prefetch,
                       issue_after=((f"rs:b{i}", rs[i]),)))
    p.append(Phase(name="bwd:head", compute_s=t.head_bwd_s, issue_after=(("rs:root", t.root_reduce_s),)))
    return p


def ddp_program(t: StepTimes, *, sync: bool = True) -> list[Phase]:
    """One micro-step under DDP: block gradients all-reduced behind the earlier blocks'
    backward, the head's last; `sync=False` is a `no_sync` micro-step (no collectives)."""
    n = len(t.block_fwd_s)
    rs = t.block_reduce_s if sync else (0.0,) * n
    if len(rs) != n or len(t.block_bwd_s) != n:
        raise TrainplanError(f"DDP program needs {n} block all-reduces and backwards; got {len(rs)}, "
                             f"{len(t.block_bwd_s)}")
    p = [Phase(name="fwd:head", compute_s=t.head_fwd_s)]
    p += [Phase(name=f"fwd:block{i}", compute_s=t.block_fwd_s[i]) for i in range(n)]
    tail_after = (("ar:tail", t.tail_reduce_s),) if sync else ()
    p.append(Phase(name="tail", compute_s=t.tail_fwd_s + t.tail_bwd_s, issue_after=tail_after))
    for i in reversed(range(n)):
        after = ((f"ar:b{i}", rs[i]),) if sync else ()
        p.append(Phase(name=f"bwd:block{i}", compute_s=t.block_bwd_s[i], issue_after=after))
    after = (("ar:root", t.root_reduce_s),) if sync else ()
    p.append(Phase(name="bwd:head", compute_s=t.head_bwd_s, issue_after=after))
    return p


def step_timeline(t: StepTimes, *, zero_stage: int, grad_accum: int = 1) -> Timeline:
    """The timeline of one optimizer step of `grad_accum` micro-steps (before the optimizer).

    Raises:
        TrainplanError: zero_stage not in 0..3, grad_accum < 1, or mismatched block lists."""
    if zero_stage not in (0, 1, 2, 3):
        raise TrainplanError(f"zero_stage={zero_stage!r}; valid: 0, 1, 2, 3")
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
        raise TrainplanError(f"grad_accum={grad_accum!r} must be an integer >= 1")
    phases: list[Phase] = []
    for k in range(grad_accum):
        if zero_stage >= 2:
            micro = fsdp_program(t, reshard_after_forward=zero_stage == 3)
        else:
            micro = ddp_program(t, sync=k == grad_accum - 1)
        # names are per micro-step
        phases += [Phase(name=f"{x.name}@{k}", compute_s=x.compute_s,
                         waits=tuple(f"{w}@{k}" for w in x.waits),
                         issue_before=tuple((f"{c}@{k}", s) for c, s in x.issue_before),
                         issue_after=tuple((f"{c}@{k}", s) for c, s in x.issue_after)) for x in micro]
    return schedule(phases)


__all__ = ["Phase", "StepTimes", "Timeline", "ddp_program", "fsdp_program", "schedule", "step_timeline"]


def fwd_stream_s(x, op_overhead_s: float) -> float:
    """Seconds of a region's forward on the compute stream: its ops (`x`, a
    `trainplan.costmodels.step.roofline.RegionCost`) and their per-op overhead."""
    return x.fwd_s + x.n_fwd_ops * op_overhead_s


def bwd_stream_s(x, op_overhead_s: float) -> float:
    """Seconds of a region's backward on the compute stream: its recompute, backward ops and
    their per-op overhead (`x`, a `trainplan.costmodels.step.roofline.RegionCost`)."""
    return x.bwd_s + x.recompute_s + (x.n_ops - x.n_fwd_ops) * op_overhead_s
