"""An export's memory re-checked: the plan re-priced with the settings the exported file runs
instead of the plan's (`trainplan.planner.export.common.Export.runs`: 8-bit Adam as fp32 AdamW,
per-block checkpoint sets as every block or none, compressed activations as computed, ...), by
the same cost models that priced the plan (`trainplan.planner.api.plan_for_choice`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from trainplan.errors import TrainplanError, UnknownNameError
from trainplan.planner.export.common import Export
from trainplan.planner.plan import Plan

GIB = 2**30


@dataclass(frozen=True, slots=True)
class Repriced:
    """The plan's per-device memory beside what the exported file runs, in bytes at the
    predicted peak (`Predictions.memory_bytes["total"]`)."""

    target: str
    runs: dict[str, Any]
    """The layout decisions the file runs instead of the plan's (`Export.runs`)."""
    planned_bytes: float
    """The plan's prediction."""
    runs_bytes: float
    """The prediction for the decisions the file runs."""
    limit_bytes: float
    """The plan's usable bytes per device (`Predictions.memory_limit_bytes`)."""

    @property
    def fits(self) -> bool:
        return self.runs_bytes <= self.limit_bytes

    def line(self) -> str:
        """One line: both numbers, the limit and what was substituted."""
        changed = ", ".join(f"{k}={_short(v)}" for k, v in self.runs.items())
        verdict = "fits" if self.fits else "does not fit"
        return (f"{self.target} runs {changed}: {self.runs_bytes / GIB:.2f} GiB per device (the plan: "
                f"{self.planned_bytes / GIB:.2f} GiB), {verdict} in the {self.limit_bytes / GIB:.2f} GiB usable")


def _short(v: Any) -> str:
    if isinstance(v, tuple) and v and len(set(v)) == 1:
        return f"{v[0]} x {len(v)}"
    return str(v)


def rebuildable(plan: Plan) -> bool:
    """Whether `plan`'s model can be built again from the plan alone: a preset, or a config-built
    model (`Plan.hf_config`); a user's own module cannot."""
    from trainplan.modeling.presets import get_preset

    if plan.hf_config is not None:
        return True
    try:
        get_preset(plan.model)
    except UnknownNameError:
        return False
    return True


def reprice(plan: Plan, e: Export) -> Repriced | None:
    """`plan` re-priced with what export `e` runs (`e.runs`); None when the file runs every
    layout decision as the plan does, or the model cannot be rebuilt (`rebuildable`).

    Raises:
        TrainplanError: the plan's model, hardware or decisions cannot be priced again (an
            unknown profile, a layer count that is not the model's), named by
            `trainplan.planner.api.plan_for_choice`.
    """
    runs = e.runs
    if not runs or not rebuildable(plan):
        return None
    from trainplan.planner.api import plan_for_choice

    model: Any = plan.model
    if plan.hf_config is not None:
        from trainplan.modeling.configs import build_from_config

        model = build_from_config(plan.hf_config, device="meta", vocab_size=plan.vocab_size, name=plan.model)
    d = dataclasses.replace(plan.decisions, **runs)
    used = set(d.activation_checkpoint)
    try:
        again = plan_for_choice(
            model, plan.hw, seq_len=d.seq_len, micro_batch=d.micro_batch, grad_accum=d.grad_accum,
            activation_checkpoint=d.activation_checkpoint,
            checkpoint_sets={k: v for k, v in d.checkpoint_sets.items() if k in used}, sp_degree=d.sp_degree,
            devices=d.devices, zero_stage=d.zero_stage, optimizer_bits=d.optimizer_bits,
            activation_bits=d.activation_bits, precision=d.precision, max_steps=d.max_steps,
            data_tokens=plan.data_tokens, vocab_size=plan.vocab_size, lr=d.lr, seed=d.seed,
            loss_chunks=d.loss_chunks, mlp_chunks=d.mlp_chunks, offload=d.offload)
    except TrainplanError as err:
        hint = ("; for a plan solved with --hw FILE.toml, give export the same --hw FILE.toml"
                if isinstance(err, UnknownNameError) else "")
        raise type(err)(f"cannot re-check the memory of the {e.target} export ({err}{hint}); give a plan written "
                        "by `trainplan solve --json`, or --force to write the file unchecked") from None
    return Repriced(target=e.target, runs=runs, planned_bytes=plan.predictions.memory_bytes.get("total", 0.0),
                    runs_bytes=again.predictions.memory_bytes["total"],
                    limit_bytes=plan.predictions.memory_limit_bytes)
