"""trainplan.executor.reporting.trackers: a synthetic run reported to TensorBoard (read back with
TensorBoard's reader, equal to the record), rank 0 only, resumed runs, wandb and trackio through
stand-in modules, missing extras and the command-line flags (the real run's TensorBoard files
are checked in test_train.py)."""

from __future__ import annotations

import importlib.machinery
import sys
import types
import warnings
from pathlib import Path

import pytest

from tests.support import MIB, make_plan, tensorboard_scalars
from trainplan.errors import MissingExtraError, OutputPathError, TrainplanError
from trainplan.executor import worker
from trainplan.executor.record import RunRecord
from trainplan.executor.reporting.trackers import (
    Cursor,
    RunTrackers,
    TrackerSpec,
    comparison_scalars,
    open_trackers,
    step_scalars,
)
from trainplan.planner.cli.main import build_parser

STEPS = 6
TOKENS_PER_STEP = 4096


def simulate(tracker: RunTrackers | None, rec: RunRecord, steps: int = STEPS) -> RunRecord:
    """Fill `rec` as `trainplan.executor.train.run` does, step by step (steps 0-1 warm-up, 2 memory, 3
    FLOPs, then timed; held-out loss every 3 steps), calling `tracker.log` after each."""
    for step in range(rec.steps, rec.steps + steps):
        if step == 2:
            rec.peak_memory_bytes = {"params": 100 * MIB, "activations": 600 * MIB, "total": 700 * MIB}
        elif step == 3:
            rec.flops_per_step = 2.1e12
        else:
            rec.step_times_s.append(0.5 + 0.01 * step)
            rec.step_cpu_times_s.append(0.45 + 0.01 * step)
        rec.steps, rec.tokens = step + 1, (step + 1) * TOKENS_PER_STEP
        rec.train_loss.append((step, 5.0 - 0.1 * step))
        if rec.steps % 3 == 0:
            rec.heldout_loss.append((rec.steps, rec.tokens, 5.1 - 0.1 * step))
        if tracker is not None:
            tracker.log(rec)
    return rec


def empty_record() -> RunRecord:
    return RunRecord(model="tiny-llama", hw_planned="h200", device="cpu", same_hardware=True)


def values(scalars, tag):
    return [(s, pytest.approx(v, rel=1e-6)) for s, v in scalars[tag]]


def test_tensorboard_holds_the_records_scalars(tmp_path):
    plan = make_plan()
    rec = empty_record()
    tracker = open_trackers(TrackerSpec(tensorboard=str(tmp_path / "tb")), plan, rec, out=tmp_path)
    simulate(tracker, rec)
    tracker.close(rec)
    got = tensorboard_scalars(tmp_path / "tb")
    assert values(got, "train/loss_nats") == [(s + 1, loss) for s, loss in rec.train_loss]
    assert values(got, "train/tokens") == [(s, s * TOKENS_PER_STEP) for s in range(1, STEPS + 1)]
    assert values(got, "heldout/loss_nats") == [(s, loss) for s, _, loss in rec.heldout_loss]
    timed = [1, 2, 5, 6]  # steps done after each timed step
    assert values(got, "time/step_s") == list(zip(timed, rec.step_times_s, strict=True))
    assert values(got, "time/step_cpu_s") == list(zip(timed, rec.step_cpu_times_s, strict=True))
    assert values(got, "memory/peak_bytes") == [(3, 700 * MIB)]
    # predicted beside measured at each evaluation (steps 3 and 6), the last one the record's
    final = comparison_scalars(plan, rec)
    assert final["predicted/peak_memory_bytes"] == plan.predictions.memory_bytes["total"]
    assert final["measured/peak_memory_bytes"] == 700 * MIB
    assert final["predicted/step_time_s"] == plan.predictions.step_time_s
    assert final["measured/step_time_s"] == rec.median_step_time_s
    assert final["predicted/final_loss_nats"] == plan.predictions.final_loss
    assert final["measured/final_loss_nats"] == rec.final_heldout_loss
    assert final["measured/flops_per_step"] == 2.1e12 and final["measured/tokens"] == rec.tokens
    assert final["rel_err/peak_memory_bytes"] == pytest.approx((720 - 700) / 700)
    for tag, value in final.items():
        assert got[tag][-1] == (STEPS, pytest.approx(value, rel=1e-6)), tag
    assert [s for s, _ in got["predicted/peak_memory_bytes"]] == [3, 6]  # not again at close


def test_only_rank_0_reports_and_none_is_no_tracker(tmp_path):
    plan, rec = make_plan(), empty_record()
    spec = TrackerSpec(tensorboard=str(tmp_path / "tb"))
    for tracker in (open_trackers(spec, plan, rec, out=tmp_path, rank=1), open_trackers(None, plan, rec, out=tmp_path)):
        assert tracker.backends == []
        simulate(tracker, rec, steps=1)
        tracker.close(rec)
    assert not (tmp_path / "tb").exists()


def test_a_resumed_run_reports_only_its_new_steps():
    rec = simulate(None, empty_record(), steps=4)
    cursor = Cursor.at(rec)
    assert step_scalars(rec, cursor) == {}
    simulate(None, rec, steps=1)
    assert step_scalars(rec, cursor) == {5: {"train/loss_nats": 4.6, "train/tokens": 5 * TOKENS_PER_STEP,
                                             "time/step_s": 0.54, "time/step_cpu_s": 0.49}}


class StandIn:
    """A stand-in for the wandb or trackio module: `init` returns a run recording its calls."""

    def __init__(self, name: str):
        self.module = types.ModuleType(name)
        self.module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        self.module.init = self.init
        self.calls: list = []

    def init(self, **kw):
        self.calls.append(("init", kw))
        return types.SimpleNamespace(log=lambda scalars, step: self.calls.append(("log", step, scalars)),
                                     finish=lambda: self.calls.append(("finish",)))


@pytest.mark.parametrize("name", ["wandb", "trackio"])
def test_wandb_and_trackio_get_the_same_scalars(name, tmp_path, monkeypatch):
    lib = StandIn(name)
    monkeypatch.setitem(sys.modules, name, lib.module)
    plan, rec = make_plan(), empty_record()
    spec = TrackerSpec(**{f"{name}_project": "proj"})
    tracker = open_trackers(spec, plan, rec, out=tmp_path / "run-7")
    simulate(tracker, rec)
    tracker.close(rec)
    (kind, init), *logs, last = lib.calls
    assert kind == "init" and init["project"] == "proj" and init["name"] == "run-7"
    assert init["config"]["model"] == "tiny-llama" and init["config"]["decisions"]["micro_batch"] == 4
    assert (name == "wandb") == ("dir" in init) and last == ("finish",)
    losses = [(step, s["train/loss_nats"]) for _, step, s in logs if "train/loss_nats" in s]
    assert losses == [(s + 1, loss) for s, loss in rec.train_loss]
    assert logs[-1][1:] == (STEPS, {"heldout/loss_nats": rec.final_heldout_loss,
                                    "time/step_s": rec.step_times_s[-1], "time/step_cpu_s": rec.step_cpu_times_s[-1],
                                    "train/loss_nats": rec.train_loss[-1][1], "train/tokens": rec.tokens}
                            | comparison_scalars(plan, rec))


def test_a_missing_tracker_names_its_extra_before_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(MissingExtraError, match=r"--wandb-project needs wandb, which is not installed: "
                                                r"pip install 'trainplan\[wandb\]'"):
        open_trackers(TrackerSpec(wandb_project="p"), make_plan(), empty_record(), out=tmp_path)
    with pytest.raises(TrainplanError, match="--tensorboard is empty"):
        TrackerSpec(tensorboard=" ").check()


def test_a_tensorboard_folder_that_cannot_be_written_is_an_output_path_error(tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(OutputPathError, match="--tensorboard '.*a_file': cannot write event files there"):
        open_trackers(TrackerSpec(tensorboard=str(tmp_path / "a_file")), make_plan(), empty_record(), out=tmp_path)


def test_a_tracker_that_fails_at_the_end_is_a_warning(tmp_path):
    class Broken:
        def log(self, scalars, step):
            raise OSError("disk full")

        def flush(self):
            pass

        def close(self):
            raise RuntimeError("gone")

    tracker = RunTrackers([Broken()], make_plan(), empty_record())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker.close(simulate(None, empty_record(), steps=2))
    assert [str(w.message) for w in caught] == ["Broken: the run's last scalars were not reported: disk full",
                                                "Broken did not close: gone"]


@pytest.mark.parametrize("command", ["run plan.json --out r", "demo"])
def test_cli_flags(command):
    args = build_parser().parse_args([*command.split(), "--tensorboard", "tb", "--wandb-project", "w"])
    assert TrackerSpec.from_args(args) == TrackerSpec(tensorboard="tb", wandb_project="w")
    assert TrackerSpec.from_args(build_parser().parse_args(command.split())) is None


def test_the_workers_get_the_same_trackers(tmp_path, monkeypatch):
    make_plan().to_json(tmp_path / "plan.json")
    spec = TrackerSpec(tensorboard="tb", trackio_project="t")
    assert spec.argv() == ["--tensorboard", str(Path("tb").resolve()), "--trackio-project", "t"]
    seen = {}
    monkeypatch.setattr(worker, "load_corpus", lambda *a, **kw: None)
    monkeypatch.setattr(worker, "run", lambda plan, **kw: seen.update(kw))
    assert worker.main([str(tmp_path / "plan.json"), "--out", str(tmp_path), *spec.argv()]) == 0
    assert seen["trackers"] == TrackerSpec(tensorboard=str(Path("tb").resolve()), trackio_project="t")
