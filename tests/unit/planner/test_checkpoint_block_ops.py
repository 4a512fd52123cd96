"""`Decisions.checkpoint_block_ops`: what the planner records of each checkpointed block kind (its
layers and the ops of its captured forward), its JSON round trip and schema, and plans written
before the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainplan.costmodels.checkpoint_sets import node_keys
from trainplan.errors import PlanMismatchError
from trainplan.planner.api import plan_for_choice
from trainplan.planner.capture.graph import capture
from trainplan.planner.plan import Plan
from trainplan.planner.schema_files import SCHEMA_DIR

ROOT = Path(__file__).resolve().parents[3]
CHECKPOINT = ("none", "full", "none", "save_matmuls")


@pytest.fixture(scope="module")
def plan(tiny_llama) -> Plan:
    return plan_for_choice(tiny_llama(num_hidden_layers=4), "cpu", seq_len=32, micro_batch=1,
                           activation_checkpoint=CHECKPOINT)


def test_the_plan_records_the_captured_ops_of_each_checkpointed_block_kind(plan, tiny_llama):
    ops = plan.decisions.checkpoint_block_ops
    region = capture(tiny_llama(num_hidden_layers=4, device="meta")).regions["block0"]
    assert list(ops) == ["block0"] and ops["block0"]["layers"] == [1, 3]
    assert ops["block0"]["ops"] == [k.rpartition("#")[0] for k in node_keys(region).values()]
    assert ops["block0"]["device_type"] == "cpu" and "attention" in ops["block0"]["ops"]


def test_a_plan_without_checkpointing_records_none(tiny_llama):
    plan = plan_for_choice(tiny_llama(), "cpu", seq_len=32, micro_batch=1)
    assert plan.decisions.checkpoint_block_ops == {}


def test_round_trip_and_json_schema(plan):
    back = Plan.from_json(plan.to_json())
    assert back == plan and back.decisions.checkpoint_block_ops == plan.decisions.checkpoint_block_ops
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((ROOT / SCHEMA_DIR / "plan.schema.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(json.loads(plan.to_json()))


def test_a_plan_written_before_the_field_still_loads(plan):
    raw = json.loads(plan.to_json())
    del raw["decisions"]["checkpoint_block_ops"]
    old = Plan.from_json(json.dumps(raw))
    assert old.decisions.checkpoint_block_ops == {} and old.decisions.activation_checkpoint == CHECKPOINT


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda e: e.update(layers=[7]), "names layer 7, the model has 4 layers"),
    (lambda e: e.update(ops=[]), "checkpoint_block_ops"),
    (lambda e: e.update(ops="aten.mm.default"), "checkpoint_block_ops"),
    (lambda e: e.update(extra=1), "checkpoint_block_ops"),
])
def test_a_corrupt_entry_is_refused(plan, edit, needle):
    raw = json.loads(plan.to_json())
    edit(raw["decisions"]["checkpoint_block_ops"]["block0"])
    with pytest.raises(PlanMismatchError, match=needle) as e:
        Plan.from_json(json.dumps(raw))
    assert "\n" not in str(e.value)
