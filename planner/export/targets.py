"""The export targets by name and `export_plan`, the one entry point: a Plan as torchtitan's,
DeepSpeed's or accelerate's native config.
"""

from __future__ import annotations

from collections.abc import Callable

from trainplan.errors import TrainplanError
from trainplan.planner.export import accelerate_yaml, deepspeed_json, torchtitan_job
from trainplan.planner.export.common import Export
from trainplan.planner.plan import Plan

TARGETS: dict[str, Callable[[Plan], Export]] = {
    "torchtitan": torchtitan_job.export,
    "deepspeed": deepspeed_json.export,
    "accelerate": accelerate_yaml.export,
}
"""Target name -> its exporter (`--to` of `trainplan export`)."""
SUFFIXES = {"torchtitan": ".toml", "deepspeed": ".json", "accelerate": ".yaml"}
"""The file suffix of each target's config."""


def export_plan(plan: Plan, to: str) -> Export:
    """`plan` as the native config of framework `to` (`TARGETS`): the file's text and the
    decisions the framework cannot express, each with what the file uses instead.

    Raises:
        TrainplanError: `to` is not a target (names the valid ones), or the target cannot
            express the plan at all (torchtitan: a model it has no flavor for).
    """
    if to not in TARGETS:
        raise TrainplanError(f"unknown export target {to!r}: valid targets are {', '.join(TARGETS)}")
    return TARGETS[to](plan)
