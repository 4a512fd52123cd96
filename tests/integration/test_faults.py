"""Faults during a run: SIGINT/SIGTERM (a checkpoint and the record so far, one line from the
CLI), running out of memory (a typed error naming the step and the predicted peak, a partial
record), resuming with a different plan or corpus or without a checkpoint (typed errors)."""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trainplan.errors import PlanMismatchError, TrainplanError
from trainplan.executor.checkpoint import OutOfMemoryRunError, is_out_of_memory, latest_checkpoint, load_checkpoint
from trainplan.executor.data.batches import load_corpus
from trainplan.executor.optimizers import build_optimizer
from trainplan.executor.record import RunRecord
from trainplan.executor.train import run
from trainplan.modeling.presets import build_model
from trainplan.planner.api import plan_for_choice
from trainplan.planner.cli.main import main

CPU_OOM = ("DefaultCPUAllocator: can't allocate memory: you tried to allocate 68719476736 bytes. "
           "Error code 12 (Cannot allocate memory)")
WORDS = ["to", "be", "or", "not", "to", "be", "that", "is", "the", "question", "whether", "tis", "nobler",
         "in", "the", "mind", "to", "suffer"]


@pytest.fixture(scope="module")
def corpus_path(tmp_path_factory) -> Path:
    rng = random.Random(2)
    path = tmp_path_factory.mktemp("corpus") / "faults.txt"
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(15)) for _ in range(600))
                    + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def corpus(corpus_path):
    return load_corpus([corpus_path], vocab_size=512)


@pytest.fixture(scope="module")
def make_plan(corpus, cpu_profile):
    """`make_plan(max_steps=12, **knobs)`: a fixed tiny-llama plan for the corpus (the session's
    cpu profile passed in, so that no other thread count measures its own)."""
    def make(max_steps: int = 12, **knobs):
        return plan_for_choice("tiny-llama", cpu_profile, seq_len=64, micro_batch=2,
                               max_steps=max_steps, vocab_size=corpus.vocab_size, **knobs)

    return make


def model_that(corpus, plan, on_training_call):
    """The plan's model whose forward calls `on_training_call(n)` before the n-th (0-based)
    forward in training mode (one per step; held-out evaluations do not count)."""
    model = build_model(plan.model, device="cpu", vocab_size=corpus.vocab_size, seed=plan.decisions.seed)
    forward, calls = model.forward, []

    def wrapped(*args, **kwargs):
        if model.training:
            on_training_call(len(calls))
            calls.append(1)
        return forward(*args, **kwargs)

    model.forward = wrapped
    return model


def one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip() and "kernels" not in ln]  # bnb's import notice
    assert "Traceback" not in err, err
    assert len([ln for ln in lines if ln.startswith("trainplan:")]) == 1, err
    assert lines[-1].startswith("trainplan:"), err
    return lines[-1]


@pytest.mark.parametrize(("exc", "expected"), [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (RuntimeError(CPU_OOM), True),
    (RuntimeError("HIP out of memory"), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
    (ValueError("can't allocate memory"), False),
])
def test_is_out_of_memory(exc, expected):
    assert is_out_of_memory(exc) is expected


# ---------------------------------------------------------------- out of memory


def test_out_of_memory_is_a_clean_error_with_a_partial_record(make_plan, corpus, corpus_path,
                                                              tmp_path, monkeypatch, capsys,
                                                              one_thread):
    """The CPU allocator's error in step 3's forward: the CLI prints one line naming the step,
    the predicted peak and what to change, exits 1 (a run that failed); the record keeps steps 0..2."""
    import trainplan.modeling.presets

    plan = make_plan()
    plan.to_json(tmp_path / "plan.json")

    def oom_at_step_3(n):
        if n == 3:
            raise RuntimeError(CPU_OOM)

    monkeypatch.setattr(trainplan.modeling.presets, "build_model",
                        lambda *a, **k: model_that(corpus, plan, oom_at_step_3))
    out = tmp_path / "run"
    code = main(["run", str(tmp_path / "plan.json"), "--out", str(out), "--data", str(corpus_path),
                 "--device", "cpu"])
    line = one_error_line(capsys.readouterr().err)
    assert code == 1, line
    assert line.startswith("trainplan: error: out of memory in step 3 on cpu"), line
    predicted_mib = f"{plan.predictions.memory_bytes['total'] / 2**20:.3g} MiB"
    for part in (predicted_mib, "smaller micro-batch (now 2)", "activation checkpointing",
                 str(out / "record.json")):
        assert part in line, (part, line)
    rec = RunRecord.from_json(out / "record.json")
    assert rec.stop_reason == "out_of_memory" and rec.steps == 3, (rec.stop_reason, rec.steps)
    assert [s for s, _ in rec.train_loss] == [0, 1, 2] and len(rec.heldout_loss) == 3
    assert any("can't allocate memory" in n for n in rec.notes), rec.notes


def test_out_of_memory_error_type(make_plan, corpus, tmp_path, one_thread):
    plan = make_plan(max_steps=3)

    def oom(n):
        if n == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(OutOfMemoryRunError, match="out of memory in step 1") as info:
        run(plan, model_that(corpus, plan, oom), corpus, out=tmp_path, device="cpu", progress=False)
    assert isinstance(info.value, TrainplanError)
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)


# ---------------------------------------------------------------- interrupts


def test_sigint_during_a_step_stops_at_the_step_boundary(make_plan, corpus, tmp_path,
                                                          one_thread):
    plan = make_plan()

    def ctrl_c_in_step_4(n):
        if n == 4:
            os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)
    rec = run(plan, model_that(corpus, plan, ctrl_c_in_step_4), corpus, out=tmp_path,
              device="cpu", progress=False)
    assert rec.stop_reason == "interrupted" and rec.steps == 5, (rec.stop_reason, rec.steps)
    assert any("SIGINT" in n for n in rec.notes), rec.notes
    assert latest_checkpoint(tmp_path).name == "step-000005"
    assert RunRecord.from_json(tmp_path / "record.json") == rec
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored


def test_a_second_sigint_stops_at_once_and_keeps_the_record(make_plan, corpus, tmp_path,
                                                            one_thread):
    plan = make_plan()

    def ctrl_c_twice_in_step_4(n):
        if n == 4:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        run(plan, model_that(corpus, plan, ctrl_c_twice_in_step_4), corpus, out=tmp_path,
            device="cpu", progress=False, checkpoint_every=2)
    rec = RunRecord.from_json(tmp_path / "record.json")
    assert rec.stop_reason == "interrupted" and rec.steps == 4, (rec.stop_reason, rec.steps)
    assert latest_checkpoint(tmp_path).name == "step-000004" == Path(rec.checkpoint).name


def test_sigterm_to_trainplan_run(make_plan, corpus, corpus_path, tmp_path):
    """A real SIGTERM to `python -m trainplan run` mid-run: exit status 130, one line on stderr,
    a record with the steps so far and a checkpoint that loads."""
    plan = make_plan(max_steps=200)  # the record is first written at step 20
    plan.to_json(tmp_path / "plan.json")
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "trainplan", "run", str(tmp_path / "plan.json"),
                             "--out", str(out), "--data", str(corpus_path), "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 240
        while not (out / "record.json").exists() and proc.poll() is None:
            assert time.monotonic() < deadline, "no record.json after 240 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        proc.kill()
    line = one_error_line(stderr)
    assert proc.returncode == 130, (proc.returncode, stderr)
    assert stdout == "", stdout
    rec = RunRecord.from_json(out / "record.json")
    assert rec.stop_reason == "interrupted" and 0 < rec.steps < 200, (rec.stop_reason, rec.steps)
    assert line.startswith(f"trainplan: interrupted after {rec.steps} of 200 steps"), line
    assert "trainplan run --out" in line and "--resume" in line, line
    assert [s for s, _ in rec.train_loss] == list(range(rec.steps))
    assert any("SIGTERM" in n for n in rec.notes), rec.notes
    path = latest_checkpoint(out)
    assert path is not None and str(path) == rec.checkpoint, (path, rec.checkpoint)
    model = build_model(plan.model, device="cpu", vocab_size=corpus.vocab_size, seed=7)
    opt = build_optimizer(model.parameters(), bits=32, lr=plan.decisions.lr)
    meta = load_checkpoint(path, model, opt, corpus={"name": corpus.name, "sha256": corpus.sha256},
                           dev=torch.device("cpu"))
    assert meta["steps"] == rec.steps and meta["record"] == rec
    assert int(opt.state[next(iter(model.parameters()))]["step"]) == rec.steps


# ---------------------------------------------------------------- resuming the wrong thing


@pytest.fixture(scope="module")
def finished_run(make_plan, corpus, tmp_path_factory, one_thread):
    plan = make_plan(max_steps=3)
    out = tmp_path_factory.mktemp("finished")
    run(plan, data=corpus, out=out, device="cpu", progress=False)
    return plan, out


def test_resume_with_a_different_plan_names_the_difference(make_plan, corpus, finished_run,
                                                           tmp_path, capsys):
    plan, out = finished_run
    other = make_plan(max_steps=3, lr=1e-3)
    with pytest.raises(PlanMismatchError, match=r"decisions\.lr: 0\.003 -> 0\.001") as info:
        run(other, data=corpus, out=out, device="cpu", progress=False, resume=True)
    assert "max_steps" not in str(info.value), info.value
    longer = make_plan(max_steps=5)
    longer.to_json(tmp_path / "longer.json")
    assert main(["run", str(tmp_path / "longer.json"), "--out", str(out), "--resume"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "decisions.max_steps: 3 -> 5" in line and "decisions.max_tokens" in line, line


def test_resume_with_another_corpus_is_a_mismatch(corpus, finished_run):
    plan, out = finished_run
    other = dataclasses.replace(corpus, name="other.txt", sha256="0" * 64)
    with pytest.raises(PlanMismatchError, match="trained on corpus .* pass the same --data"):
        run(plan, data=other, out=out, device="cpu", progress=False, resume=True)


def test_resume_needs_a_run_with_a_checkpoint(make_plan, corpus, tmp_path, capsys):
    plan = make_plan(max_steps=3)
    with pytest.raises(TrainplanError, match="cannot resume: .*plan.json does not exist"):
        run(plan, data=corpus, out=tmp_path, device="cpu", progress=False, resume=True)
    plan.to_json(tmp_path / "plan.json")
    with pytest.raises(TrainplanError, match="cannot resume: no checkpoint in"):
        run(plan, data=corpus, out=tmp_path, device="cpu", progress=False, resume=True)
    assert main(["run", "--out", str(tmp_path)]) == 2
    assert "give a PLAN to run, or --resume" in one_error_line(capsys.readouterr().err)
    assert main(["run", "--out", str(tmp_path / "nowhere"), "--resume"]) == 2
    assert "cannot resume: no plan at" in one_error_line(capsys.readouterr().err)
