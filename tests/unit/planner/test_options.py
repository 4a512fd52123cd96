"""`trainplan.SolveOptions`: one typed object for `solve`'s options, the same plan from keywords or
the object, unknown names refused by name, and the plan records what it was solved with."""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys

import pytest

import trainplan
from trainplan.errors import TrainplanError
from trainplan.planner.options import DEFAULT_DATA_METHODS, DEFAULT_POLICIES, OPTION_NAMES, SolveOptions, options_from
from trainplan.planner.plan import Plan

BUDGET = trainplan.Budget(wall_clock_s=3600)


@pytest.fixture(scope="module")
def by_keywords() -> Plan:
    return trainplan.solve("tiny-llama", "cpu", BUDGET, seq_len=128, micro_batches=[1, 2])


def test_keywords_and_the_object_give_the_same_plan(by_keywords):
    by_object = trainplan.solve("tiny-llama", "cpu", BUDGET, SolveOptions(seq_len=128, micro_batches=(1, 2)))
    assert by_object.decisions == by_keywords.decisions
    assert by_object.options == by_keywords.options


def test_keywords_override_the_object(by_keywords):
    plan = trainplan.solve("tiny-llama", "cpu", BUDGET, SolveOptions(seq_len=64, micro_batches=(1, 2)),
                           seq_len=128)
    assert plan.decisions.seq_len == 128
    assert plan.options == by_keywords.options


def test_the_plan_records_its_options_and_they_round_trip(by_keywords, tmp_path):
    rec = by_keywords.options
    assert rec is not None and set(rec) == set(OPTION_NAMES)
    assert rec["seq_len"] == 128 and rec["micro_batches"] == [1, 2] and rec["data"] is None
    json.dumps(rec)  # JSON values only
    back = Plan.from_json(by_keywords.to_json(tmp_path / "p.json"))
    assert back.options == rec
    assert SolveOptions(**{k: v for k, v in rec.items() if k not in ("law", "data", "data_quality")}).recorded() == rec


def test_a_plan_written_before_the_field_reads_none(by_keywords):
    raw = json.loads(by_keywords.to_json())
    del raw["options"]
    assert Plan.from_json(json.dumps(raw)).options is None


@pytest.mark.parametrize("name, close", [("seqlen", "seq_len"), ("time_limit", "time_limit_s"), ("zzz", None)])
def test_an_unknown_option_is_named_with_the_closest(name, close):
    with pytest.raises(TrainplanError, match=f"no option '{name}'") as e:
        trainplan.solve("tiny-llama", "cpu", BUDGET, **{name: 1})
    assert (f"did you mean '{close}'" in str(e.value)) == (close is not None)
    assert "seq_len, " in str(e.value)  # the valid names


def test_options_must_be_a_solve_options():
    with pytest.raises(TrainplanError, match="options must be a trainplan.SolveOptions, got dict"):
        options_from({"seq_len": 128})  # type: ignore[arg-type]


def test_every_option_has_a_docstring_and_the_defaults_agree_with_the_solver():
    source = inspect.getsource(SolveOptions)
    for f in dataclasses.fields(SolveOptions):
        after = source.split(f"\n    {f.name}: ", 1)[1].split("\n", 1)[1].lstrip()
        assert after.startswith('"""'), f"SolveOptions.{f.name} has no docstring"
    defaults = SolveOptions()
    assert defaults.policies == DEFAULT_POLICIES
    assert defaults.data_methods == DEFAULT_DATA_METHODS


def test_solve_options_is_light():
    code = "import sys, trainplan; trainplan.SolveOptions(seq_len=8); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_corpus_is_recorded_by_name_fingerprint_and_size():
    class Corpus:
        name, sha256, vocab_size, train_tokens, heldout_tokens = "shakespeare", "ab12", 50257, [1, 2, 3], [4]

    assert SolveOptions(data=Corpus()).recorded()["data"] == {"name": "shakespeare", "sha256": "ab12",
                                                              "n_train_tokens": 3}
