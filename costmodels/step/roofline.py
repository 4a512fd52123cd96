"""The per-op roofline: FLOPs and seconds of each captured op, and their sums over a region.

Each op's FLOPs come from torch's `flop_counter` formulas, captured as polynomials in micro-batch
and sequence length (`trainplan.costmodels.graph.Poly`); its time is the roofline over the hardware
profile (Williams et al. 2009, "Roofline: an insightful visual performance model for multicore
architectures", CACM 52(4)): the larger of compute time at the profile's peak scaled by its
matmul efficiency curve (efficiency curves as data, as Calculon does, Isaev et al. 2023) and
memory time at its HBM bandwidth. Shared by the step model (`trainplan.costmodels.step.model`) and the
exact cost of a checkpoint set (`trainplan.costmodels.step.remat_cost`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from trainplan.costmodels.checkpoint_sets import CheckpointSet, resolve, saved_nodes
from trainplan.costmodels.graph import Poly, Region
from trainplan.hardware_profiles import HardwareProfile


def flops_at(p: Poly, b: float, s_local: float, sp: int) -> float:
    """FLOPs of a node per rank. Terms in s**2 are attention, whose heads (not sequence) are
    sharded under Ulysses: b * (h/P) * s**2 = b * h * s_local**2 * P."""
    return sum(c * b**i * s_local**j * (sp ** (j - 1) if j >= 2 else 1) for i, j, c in p)


@dataclass(frozen=True, kw_only=True, slots=True)
class RegionCost:
    """FLOPs and roofline seconds of a region's forward, backward and recompute, per rank."""

    fwd_flops: float
    """FLOPs of the forward ops."""
    bwd_flops: float
    """FLOPs of the backward ops."""
    recompute_flops: float
    """FLOPs of the forward ops a checkpointed region replays before its backward."""
    fwd_s: float
    """Roofline seconds of the forward ops (per-op overhead not included)."""
    bwd_s: float
    """Roofline seconds of the backward ops."""
    recompute_s: float
    """Roofline seconds of the replayed forward ops."""
    n_ops: int
    """Ops executed: forward, backward and recomputed."""
    n_fwd_ops: int = 0
    """Of which forward ops."""


def node_s(attrs: Mapping, b: float, s: float, sp: int, hw: HardwareProfile, dtype: str) -> tuple[float, float]:
    """(FLOPs, roofline seconds) of one captured op per rank at micro-batch `b`, local sequence
    `s`, Ulysses degree `sp`: max(FLOPs / (peak(dtype) x matmul efficiency at those FLOPs),
    bytes read + written / (HBM bandwidth x memory efficiency)) (Williams et al. 2009).

    Args: attrs: the op's node attributes in the captured graph (`flops`, `in_bytes`,
    `out_bytes` as `trainplan.costmodels.graph.Poly`); hw: the profile; dtype: compute dtype of the
    peak (`bf16`, `fp32`).
    Returns: (FLOPs, seconds); 0 compute time for an op without FLOPs.
    """
    f = flops_at(attrs["flops"], b, s, sp)
    moved = flops_at(attrs["in_bytes"], b, s, 1) + flops_at(attrs["out_bytes"], b, s, 1)
    t_mem = moved / (hw.hbm_bandwidth_bytes_per_s * hw.memory_efficiency)
    t_flop = f / (hw.peak(dtype) * hw.matmul_efficiency_at(f)) if f > 0 else 0.0
    return f, max(t_flop, t_mem)


def region_cost(region: Region, b: int, s_local: int, sp: int, policy: str | CheckpointSet,
                hw: HardwareProfile, dtype: str) -> RegionCost:
    """Per-rank FLOPs and roofline time of `region` at micro-batch b, local sequence s_local.

    Recompute under a checkpoint entry re-runs every forward op whose output is not saved, up
    to the early stop (`Region.recompute_horizon`)."""
    g = region.graph
    entry = resolve(policy)
    saved = saved_nodes(region, entry)
    horizon = region.recompute_horizon()
    out = dict(fwd_flops=0.0, bwd_flops=0.0, recompute_flops=0.0, fwd_s=0.0, bwd_s=0.0, recompute_s=0.0)
    n_ops = n_fwd = 0
    for n, a in g.nodes(data=True):
        f, t = node_s(a, b, s_local, sp, hw, dtype)
        ph = a["phase"]
        out[f"{ph}_flops"] += f
        out[f"{ph}_s"] += t
        n_ops += 1
        n_fwd += ph == "fwd"
        if ph == "fwd" and entry.checkpointed and n not in saved and a["order"] <= horizon:
            out["recompute_flops"] += f
            out["recompute_s"] += t
            n_ops += 1
    return RegionCost(fwd_flops=out["fwd_flops"], bwd_flops=out["bwd_flops"],
                      recompute_flops=out["recompute_flops"], fwd_s=out["fwd_s"], bwd_s=out["bwd_s"],
                      recompute_s=out["recompute_s"], n_ops=n_ops, n_fwd_ops=n_fwd)
