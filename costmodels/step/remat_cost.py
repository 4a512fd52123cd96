"""One block's rematerialization problem and the exact cost of a checkpoint set on it.

`BlockCase` is a captured transformer block at one shape on one device; `evaluate` replays a
checkpoint set's storage lifetimes (`trainplan.costmodels.step.memory.simulate_region`) and sums the
roofline time of every forward op the replay recomputes (`trainplan.costmodels.step.roofline.node_s` plus the
profile's per-op overhead). It is the referee of `trainplan.planner.joint.remat_solver`'s CP-SAT model and its menus.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainplan.costmodels.checkpoint_sets import CheckpointSet, saved_nodes
from trainplan.costmodels.graph import Region
from trainplan.costmodels.step.memory import simulate_region
from trainplan.costmodels.step.roofline import node_s
from trainplan.hardware_profiles import HardwareProfile


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockCase:
    """One block's rematerialization problem: a captured region at one shape on one device."""

    region: Region
    b: int
    """Micro-batch."""
    s: int
    """Sequence length per rank (seq_len / sp_degree)."""
    sp: int
    """Ulysses degree (attention FLOPs per rank scale with it)."""
    hw: HardwareProfile
    dtype: str
    """Compute dtype for the profile's peak (`bf16`, `fp32`)."""
    stack: int = 1
    """Identical blocks stacked in the model: the retained bytes of the others sit under this
    block's peak."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SetCost:
    """Exact cost of one checkpoint set on one block (`simulate_region` and node times)."""

    retained_bytes: float
    fwd_peak_bytes: float
    bwd_peak_bytes: float
    peak_bytes: float
    """(stack - 1) * retained + max(forward peak, backward peak): the block's contribution to
    the step peak with `stack` such blocks."""
    recompute_s: float
    """Seconds of forward replay, per-op overhead included."""
    recompute_flops: float


def forward_node_times(case: BlockCase) -> dict[str, tuple[float, float]]:
    """(FLOPs, roofline seconds) of each forward node of `case`'s block at its shape, per-op
    overhead not included: what replaying that node costs (`evaluate`, and the per-block CP-SAT
    model of `trainplan.planner.joint.remat_solver`)."""
    g, hw = case.region.graph, case.hw
    return {n: node_s(g.nodes[n], case.b, case.s, case.sp, hw, case.dtype) for n in case.region.fwd_nodes()}


def evaluate(case: BlockCase, entry: CheckpointSet) -> SetCost:
    """Exact memory (lifetime replay) and recompute cost of `entry` on `case`'s block."""
    region = case.region
    saved = saved_nodes(region, entry)
    mem = simulate_region(region, case.b, case.s, checkpoint=entry.checkpointed, saved_ops=saved)
    horizon = region.recompute_horizon()
    g = region.graph
    rec_s = rec_f = 0.0
    if entry.checkpointed:
        for n, (f, t) in forward_node_times(case).items():
            if n not in saved and g.nodes[n]["order"] <= horizon:
                rec_s += t + case.hw.op_overhead_s
                rec_f += f
    F, T = mem.fwd_peak.total, mem.bwd_peak.total
    return SetCost(retained_bytes=mem.retained, fwd_peak_bytes=F, bwd_peak_bytes=T,
                   peak_bytes=(case.stack - 1) * mem.retained + max(F, T), recompute_s=rec_s,
                   recompute_flops=rec_f)
