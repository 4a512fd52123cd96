"""The file formats' schemas (`trainplan.planner.schema_files`): the JSON Schemas in docs/schemas/ are what
the pydantic models generate now, the shipped and example files validate against them (with the
`jsonschema` library, when installed), each model declares the fields of the dataclass it reads
into, and the readers' strict checks refuse what hand checks used to miss, in one line."""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from pathlib import Path

import pytest

from tests.support import TRUE, make_plan
from trainplan.costmodels.stopping.heldout_curve import HeldoutCurve, HeldoutCurveSchema
from trainplan.errors import PlanMismatchError, TrainplanError
from trainplan.hardware_profiles.profile import HardwareProfile
from trainplan.hardware_profiles.profile_schema import ProfileSchema
from trainplan.planner.plan import Decisions, Plan, Predictions, SolverFacts
from trainplan.planner.plan_schema import DecisionsSchema, PlanSchema, PredictionsSchema, SolverFactsSchema
from trainplan.planner.schema_files import SCHEMA_DIR, SCHEMAS, schema_text

ROOT = Path(__file__).resolve().parents[2]
PROFILE_FILES = sorted((ROOT / "hardware_profiles").glob("*.toml")) + [ROOT / "docs" / "example-l40s.toml"]
CURVE_FILES = sorted((ROOT / "benchmarks" / "results").glob("*curve.json"))
PLAN_FILES = sorted((ROOT / SCHEMA_DIR / "examples").glob("plan*.json"))


def _examples() -> list[tuple[str, object]]:
    """(schema file, instance) for every example: shipped profiles, the example plan and the
    benchmark's curves, plus a plan, a profile and a curve written by today's writers."""
    out = [("hardware_profile.schema.json", tomllib.loads(p.read_text())) for p in PROFILE_FILES]
    out += [("plan.schema.json", json.loads(p.read_text())) for p in PLAN_FILES]
    out += [("heldout_curve.schema.json", json.loads(p.read_text())) for p in CURVE_FILES]
    out += [("plan.schema.json", json.loads(make_plan().to_json())),
            ("hardware_profile.schema.json", HardwareProfile.from_file(PROFILE_FILES[0]).to_dict()),
            ("heldout_curve.schema.json", json.loads(json.dumps(TRUE.to_dict())))]
    return out


def test_there_are_examples_of_each_format():
    assert len(PROFILE_FILES) >= 7 and PLAN_FILES and CURVE_FILES


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_schema_files_are_what_the_models_generate(name):
    """Regenerate with `python -m trainplan.planner.schema_files` after changing a model."""
    path = ROOT / SCHEMA_DIR / name
    assert path.read_text() == schema_text(SCHEMAS[name]), (f"{path} is stale: run "
                                                           "python -m trainplan.planner.schema_files")


def test_examples_validate_against_the_json_schemas():
    jsonschema = pytest.importorskip("jsonschema")
    for name, instance in _examples():
        schema = json.loads((ROOT / SCHEMA_DIR / name).read_text())
        jsonschema.Draft202012Validator.check_schema(schema)
        jsonschema.Draft202012Validator(schema).validate(instance)
    bad = json.loads(make_plan().to_json())
    bad["decisions"]["activation_bits"] = 12
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, json.loads((ROOT / SCHEMA_DIR / "plan.schema.json").read_text()))


def test_examples_are_read_by_the_readers():
    for path in PLAN_FILES:
        assert Plan.from_json(path).model == "tiny-llama"
    for path in PROFILE_FILES:
        assert HardwareProfile.from_file(path).name == path.stem.removeprefix("example-")
    for path in CURVE_FILES:
        assert HeldoutCurve.from_dict(json.loads(path.read_text())).E > 0


def _defaults(cls) -> dict:
    return {f.name: (f.default if f.default is not dataclasses.MISSING else
                     f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            for f in dataclasses.fields(cls)}


def _schema_defaults(model) -> dict:
    return {k: (None if f.is_required() else f.default) for k, f in model.model_fields.items()}


@pytest.mark.parametrize(("cls", "model"), [(Decisions, DecisionsSchema), (Predictions, PredictionsSchema),
                                            (SolverFacts, SolverFactsSchema), (Plan, PlanSchema),
                                            (HeldoutCurve, HeldoutCurveSchema)])
def test_each_schema_declares_its_dataclass_fields_and_defaults(cls, model):
    """A field added to a dataclass and not to its schema (or with another default) fails here."""
    mine, theirs = _defaults(cls), _schema_defaults(model)
    assert list(mine) == list(theirs)
    if cls is Plan:  # the one key a file must give though Python has a default: its version
        assert theirs.pop("format") is None and mine.pop("format") == 1
    norm = {k: (list(v) if isinstance(v, tuple) else v) for k, v in mine.items()}
    assert norm == theirs


def test_the_profile_schema_has_the_profile_fields():
    assert list(ProfileSchema.model_fields) == [f.name for f in dataclasses.fields(HardwareProfile)]


def _plan_with(**edits) -> str:
    raw = json.loads(make_plan().to_json())
    for dotted, value in edits.items():
        *parents, key = dotted.split("__")
        node = raw
        for p in parents:
            node = node[p]
        if value is _DROP:
            del node[key]
        else:
            node[key] = value
    return json.dumps(raw)


_DROP = object()


@pytest.mark.parametrize(("edits", "needle"), [
    (dict(decisions__micro_batch=True), "decisions.micro_batch=True must be a whole number >= 1"),
    (dict(decisions__optimizer_bits=8.0), "decisions.optimizer_bits=8.0 must be 32, 16, 8 or 4"),
    (dict(decisions__optimizer_bits=16), "decisions.optimizer_bits=16 must be 32, 8 or 4 at precision 'bf16-mixed'"),
    (dict(decisions__zero_stage=4), "decisions.zero_stage=4 must be 0, 1, 2 or 3"),
    (dict(decisions__data_fraction=math.nan), "decisions.data_fraction=nan must be a finite number in (0, 1]"),
    (dict(decisions__activation_checkpoint=["none"]),
     "activation_checkpoint has 1 entries, must be one name per layer (2)"),
    (dict(predictions__memory_bytes={"params": 1.0}), "predictions.memory_bytes={'params': 1.0} must hold"),
    (dict(predictions__step_time_breakdown_s={"compute": "x"}),
     "predictions.step_time_breakdown_s.compute='x' must be a finite number"),
    (dict(solver__gap=math.inf), "solver.gap=inf must be a finite number >= 0"),
    (dict(decisions__micro_batches=2), "decisions: unknown key(s) micro_batches; valid keys are devices, sp_degree"),
    (dict(extra=1), "unknown key(s) extra; valid keys are model, model_n_params"),
    (dict(decisions__seq_len=_DROP, decisions__devices=_DROP), "decisions: missing key(s) devices, seq_len"),
    (dict(notes=[1]), "notes[0]=1 must be a string"),
])
def test_a_bad_plan_field_is_named_with_its_value_and_what_is_valid(edits, needle):
    with pytest.raises(PlanMismatchError) as info:
        Plan.from_json(_plan_with(**edits))
    msg = str(info.value)
    assert needle in msg and msg.startswith("plan JSON: ") and "\n" not in msg, msg


def test_a_plan_written_before_the_optional_fields_reads_their_defaults():
    old = _plan_with(decisions__grad_accum=_DROP, decisions__activation_bits=_DROP, decisions__lr=_DROP,
                     predictions__made_for=_DROP, solver__gap=_DROP, notes=_DROP, created=_DROP)
    assert Plan.from_json(old) == make_plan()


@pytest.mark.parametrize(("edit", "needle"), [
    (dict(beta=True), "beta=True must be a finite number in [0.01, 3]"),
    (dict(cov=[[math.inf] * 6] * 6), None),  # a fit without a covariance
    (dict(param_names=["E", "B", "beta"], cov=[[1.0] * 6] * 6), "cov=[[1.0, 1.0, 1.0, 1.0, 1.0, 1.0]"),
    (dict(unique_tokens=None), None),
    (dict(E="2.5"), "E='2.5' must be a finite number in [0, 100]"),
])
def test_curve_fields(edit, needle):
    raw = json.loads(json.dumps(TRUE.to_dict())) | edit
    if needle is None:
        assert HeldoutCurve.from_dict(raw).E == TRUE.E
        return
    with pytest.raises(TrainplanError) as info:
        HeldoutCurve.from_dict(raw)
    assert str(info.value).startswith(needle), str(info.value)
