"""A step's predicted time split the way `torch.profiler` splits a measured one on an
accelerator (`trainplan.executor.kernels`): matmul, other (memory-bound) and communication seconds, for
the GPU refit of `trainplan calibrate` (`trainplan.executor.calibrate.gpu`).

The step model (`trainplan.costmodels.step.model.StepModel`) prices every captured op by its roofline
(`trainplan.costmodels.step.roofline.node_s`); the ops with FLOPs (matmuls, attention) are the kernels
`trainplan.executor.kernels.kernel_kind` calls matmul, the others are elementwise, reductions and copies.
`PartsPredictor.parts` walks the step's regions as `StepModel` runs them (head, blocks under
their checkpoint entries with the recomputed forward ops, tail), sums each kind's roofline
seconds, and scales both sums so that they add up to the model's `compute_s + recompute_s`
exactly (so gradient accumulation and whatever else the model adds to its compute time carry
over); the optimizer step (its foreach kernels) counts as other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from trainplan.costmodels.checkpoint_sets import saved_nodes
from trainplan.costmodels.step.model import Choice, StepModel
from trainplan.costmodels.step.precision import PRECISIONS
from trainplan.costmodels.step.roofline import node_s
from trainplan.hardware_profiles import HardwareProfile

__all__ = ["PartsPredictor", "PredictedParts"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PredictedParts:
    """One step's predicted seconds by kind of device time, and its memory peak, per device."""

    matmul_s: float
    """Ops with FLOPs (GEMMs, attention), recompute included."""
    other_s: float
    """Ops without FLOPs plus the optimizer step."""
    comm_s: float
    """Every collective's seconds, hidden behind compute or not (`StepCost.comm_total_s`)."""
    step_s: float
    """The whole step as the model predicts it (`StepCost.time_s`: exposed communication)."""
    n_ops: float
    """Ops the step executes (its per-op overhead over the profile's `op_overhead_s`)."""
    peak_bytes: float
    """Predicted peak tensor bytes (`StepCost.memory.total`); NaN unless asked for."""


class PartsPredictor:
    """Predicts one run's `PredictedParts` under any profile: `graph` is a captured model
    (`trainplan.planner.capture.graph.ModelGraph`: regions, blocks, heads), `numels` its parameter sizes,
    `choice` the plan's knobs (`Choice.from_decisions`)."""

    def __init__(self, graph: Any, numels: tuple[int, ...], choice: Choice):
        self.graph, self.numels, self.choice = graph, numels, choice

    def step_model(self, hw: HardwareProfile) -> StepModel:
        """The step model of this graph on `hw`."""
        g = self.graph
        return StepModel(g.regions, g.blocks, self.numels, hw, n_heads=g.n_heads, n_kv_heads=g.n_kv_heads,
                         head_dim=g.head_dim)

    def roofline_split(self, sm: StepModel) -> tuple[float, float]:
        """(ops with FLOPs, ops without) roofline seconds of one micro-step on `sm`'s profile,
        recompute included: the walk of `trainplan.costmodels.step.roofline.region_cost`, split by kind."""
        c = self.choice
        b, s, sp = c.micro_batch, c.seq_len // c.sp_degree, c.sp_degree
        dtype = PRECISIONS[c.precision][3]
        regions = [(sm.region_for(c, "head"), c.entry("none")), (sm.region_for(c, "tail"), c.entry("none"))]
        regions += [(sm.region_for(c, sm.blocks[i], c.entry(p)), c.entry(p)) for i, p in enumerate(c.policies)]
        mm = other = 0.0
        for name, entry in regions:
            region = sm.regions[name]
            saved = saved_nodes(region, entry)
            horizon = region.recompute_horizon()
            for n, a in region.graph.nodes(data=True):
                f, t = node_s(a, b, s, sp, sm.hw, dtype)
                runs = 1 + (a["phase"] == "fwd" and entry.checkpointed and n not in saved and a["order"] <= horizon)
                if f > 0:
                    mm += runs * t
                else:
                    other += runs * t
        return mm, other

    def parts(self, hw: HardwareProfile, *, memory: bool = False) -> PredictedParts:
        """The step's predicted parts on `hw`; `memory` also replays its memory (slower)."""
        sm = self.step_model(hw)
        cost = sm.evaluate(self.choice) if memory else sm.runtime(self.choice)
        mm, other = self.roofline_split(sm)
        work = cost.compute_s + cost.recompute_s
        frac = mm / (mm + other) if mm + other > 0 else 0.0
        if hw.op_overhead_s > 0:
            n_ops = cost.overhead_s / hw.op_overhead_s
        else:  # the op count alone: priced at one second per op
            n_ops = self.step_model(dataclasses.replace(hw, op_overhead_s=1.0)).runtime(self.choice).overhead_s
        return PredictedParts(matmul_s=frac * work, other_s=(1.0 - frac) * work + cost.optimizer_s,
                              comm_s=max(cost.comm_total_s, cost.comm_s), step_s=cost.time_s, n_ops=n_ops,
                              peak_bytes=cost.memory.total if memory else float("nan"))
