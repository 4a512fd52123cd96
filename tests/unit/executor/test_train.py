"""trainplan.executor.train.run: a solved tiny-llama plan run for real on this CPU (prediction against
measurement, STYLE 11) and the report folder (the 2-process run through `trainplan run` is in
tests/integration/test_resume.py)."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from tests.support import tensorboard_scalars
from trainplan.executor.data.batches import load_corpus
from trainplan.executor.record import RunRecord
from trainplan.executor.reporting.report import report
from trainplan.executor.reporting.trackers import TrackerSpec, comparison_scalars
from trainplan.executor.train import run
from trainplan.planner.api import solve
from trainplan.planner.budget import Budget
from trainplan.planner.plan import Plan, layout_fields

SEQ_LEN = 64
STEPS = 6
MICRO_BATCH = 4
RTOL = 0.01
WORDS = ["the", "king", "is", "dead", "long", "live", "the", "queen", "now", "is", "the", "winter", "of",
         "our", "discontent", "made", "glorious", "summer", "by", "this", "sun", "of", "york", "and", "all",
         "the", "clouds", "that", "lowered", "upon", "our", "house", "in", "the", "deep", "bosom", "of",
         "the", "ocean", "buried"]


@pytest.fixture(scope="module")
def corpus_path(tmp_path_factory):
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("corpus") / "tiny.txt"
    lines = (" ".join(rng.choice(WORDS) for _ in range(15)) for _ in range(1500))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def corpus(corpus_path):
    return load_corpus([corpus_path], vocab_size=512)


def _capped(plan: Plan, steps: int, **decisions) -> Plan:
    """`plan` cut to `steps` steps; `decisions` (layout edits) stand in for a plan solved for
    that layout: tokens per step and `made_for` follow the edit (`trainplan run` checks both),
    the memory and time predictions stay the original's (the tests that edit check device and
    process counts, not predictions)."""
    d = dataclasses.replace(plan.decisions, max_steps=steps, warmup_steps=2, **decisions)
    d = dataclasses.replace(d, max_tokens=steps * d.micro_batch * d.seq_len * d.dp_degree)
    p = dataclasses.replace(plan.predictions, tokens_per_step=d.micro_batch * d.seq_len * d.dp_degree,
                            made_for=layout_fields(d))
    return dataclasses.replace(plan, decisions=d, predictions=p)


@pytest.fixture(scope="module")
def plan(corpus) -> Plan:
    # micro-batch, policy and optimizer pinned so that the run (and its memory) is the same on
    # every machine; the wall-clock budget then only sets the step count, capped here
    solved = solve("tiny-llama", "cpu", Budget(wall_clock_s=600), seq_len=SEQ_LEN,
                   vocab_size=corpus.vocab_size, data_tokens=corpus.n_train_tokens,
                   micro_batches=(MICRO_BATCH,), policies=("none",), optimizer_bits=(32,))
    return _capped(solved, STEPS)


@pytest.fixture(scope="module")
def ran(plan, corpus, tmp_path_factory, torch_threads):
    out = tmp_path_factory.mktemp("run")
    # device given: the run does not load the cpu profile, whose cache is keyed by threads
    with torch_threads(1):
        record = run(plan, data=corpus, out=out, device="cpu", progress=False,
                     trackers=TrackerSpec(tensorboard=str(out / "tb")))
    return record, out


def test_plan_matches_the_corpus(plan, corpus):
    assert plan.vocab_size == corpus.vocab_size
    d = plan.decisions
    assert (d.devices, d.micro_batch, d.seq_len, d.activation_checkpoint, d.optimizer_bits, d.precision) == \
        (1, MICRO_BATCH, SEQ_LEN, ("none",) * 4, 32, "fp32"), d


def test_run_trains_and_stops_at_the_budget(ran, plan):
    record, out = ran
    assert record.stop_reason == "budget", record.stop_reason
    assert record.steps == STEPS and record.world_size == 1, (record.steps, record.world_size)
    assert record.tokens == STEPS * plan.predictions.tokens_per_step, (record.tokens, plan.predictions)
    assert [s for s, _ in record.train_loss] == list(range(STEPS))
    assert all(math.isfinite(loss) for _, loss in record.train_loss), record.train_loss
    assert record.heldout_loss and record.heldout_loss[-1][:2] == (STEPS, record.tokens), record.heldout_loss
    first, held = record.train_loss[0][1], record.final_heldout_loss
    assert math.isfinite(held) and held < first, \
        f"held-out loss {held:.3f} after {STEPS} steps, first train loss {first:.3f}"
    assert record.per_rank_peak_bytes == [record.peak_memory_bytes["total"]]
    assert RunRecord.from_json(out / "record.json") == record


def test_run_reports_its_record_to_tensorboard(ran, plan):
    record, out = ran
    got = tensorboard_scalars(out / "tb")
    approx = [(s + 1, pytest.approx(loss, rel=1e-6)) for s, loss in record.train_loss]
    assert got["train/loss_nats"] == approx
    assert got["heldout/loss_nats"] == [(s, pytest.approx(loss, rel=1e-6)) for s, _, loss in record.heldout_loss]
    assert [v for _, v in got["time/step_s"]] == pytest.approx(record.step_times_s, rel=1e-6)
    assert got["memory/peak_bytes"] == [(3, pytest.approx(record.peak_memory_bytes["total"], rel=1e-6))]
    assert got["train/tokens"][-1] == (STEPS, record.tokens)
    final = comparison_scalars(plan, record)
    assert {"predicted/peak_memory_bytes", "measured/peak_memory_bytes", "predicted/step_time_s",
            "measured/step_time_s", "predicted/final_loss_nats", "measured/final_loss_nats"} <= set(final)
    for tag, value in final.items():
        assert got[tag][-1] == (STEPS, pytest.approx(value, rel=1e-6)), tag


def test_flops_per_step_exact(ran, plan):
    record, _ = ran
    pred, meas = plan.predictions.flops_per_step, record.flops_per_step
    assert pred == meas, f"predicted {pred:.0f} FLOPs per step, FlopCounterMode {meas:.0f}"


def test_peak_memory_within_1_percent(ran, plan):
    """A known gap until #20 (1.2% under, in the last block's backward): an autograd node's saved
    tensors are now held to the end of its backward (`trainplan.planner.capture.trace`)."""
    record, _ = ran
    pred, meas = plan.predictions.memory_bytes["total"], record.peak_memory_bytes["total"]
    assert math.isclose(pred, meas, rel_tol=RTOL), (
        f"predicted peak {pred:.0f} B, MemTracker {meas:.0f} B ({(pred - meas) / meas:+.2%}); "
        f"predicted {plan.predictions.memory_bytes}, measured {record.peak_memory_bytes}")


def test_report_writes_four_files(ran, plan, tmp_path):
    record, _ = ran
    files = report(plan, record, tmp_path / "report")
    assert {"comparison", "plan", "record", "figure"} <= set(files), files
    assert [files[k].name for k in ("comparison", "plan", "record", "figure")] == \
        ["comparison.csv", "plan.json", "record.json", "report.png"], files
    for key, path in files.items():
        assert path.exists() and path.stat().st_size > 0, (key, path)
    assert Plan.from_json(files["plan"]) == plan
    assert RunRecord.from_json(files["record"]) == record
    assert "peak_memory" in files["comparison"].read_text()


# ---------------------------------------------------------------- does the plan fit here


def test_run_prints_progress_lines_when_stderr_is_not_a_terminal(plan, corpus, tmp_path, capsys,
                                                                   torch_threads):
    # under capsys stderr is not a terminal, as in a log file or CI: plain lines, no tqdm bar
    with torch_threads(1):
        run(plan, data=corpus, out=tmp_path, device="cpu", progress=True, checkpoint_every=0)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("train: step ")]
    assert "\r" not in err and len(lines) == STEPS, err
    assert lines[-1].startswith(f"train: step {STEPS}/{STEPS} (100%), loss ") and lines[-1].endswith(" s")


def test_run_refuses_a_plan_whose_memory_exceeds_this_machine(plan, corpus, tmp_path, monkeypatch):
    """Checked before the model is built: one typed error naming both numbers and the fix. The
    available RAM is fixed at 8 GiB: read twice, the machine's own changes with other processes."""
    import trainplan.executor.fit_check
    from trainplan.errors import TrainplanError
    from trainplan.executor.fit_check import PlanDoesNotFitError

    have = 8 * 2**30
    monkeypatch.setattr(trainplan.executor.fit_check, "available_ram_bytes", lambda: have)
    mem = dict(plan.predictions.memory_bytes, total=2.0 * have)
    big = dataclasses.replace(plan, predictions=dataclasses.replace(plan.predictions, memory_bytes=mem))
    with pytest.raises(PlanDoesNotFitError, match=r"RAM.*available.*trainplan solve .*--hw cpu") as e:
        run(big, data=corpus, out=tmp_path / "run", device="cpu", progress=False)
    assert isinstance(e.value, TrainplanError)
    assert f"{2.0 * have / 2**30:.2f} GiB" in str(e.value) and f"{have / 2**30:.2f} GiB" in str(e.value)
    assert not (tmp_path / "run" / "record.json").exists()


def test_launch_refuses_more_processes_than_this_machine_can_host(plan, tmp_path, monkeypatch):
    import trainplan.executor.fit_check as fit
    import trainplan.executor.worker as worker
    from trainplan.executor.fit_check import PlanDoesNotFitError

    monkeypatch.setattr(fit.os, "cpu_count", lambda: 1)
    n = fit.CPU_PROCESSES_PER_CORE + 1
    _capped(plan, plan.decisions.max_steps, devices=n, dp_degree=n, sp_degree=1).to_json(tmp_path / "plan.json")
    monkeypatch.setattr(worker, "run_torchrun", lambda *a, **k: pytest.fail("torchrun started"))
    with pytest.raises(PlanDoesNotFitError, match=rf"plan runs {n} processes .* 1 CPU core"):
        worker.launch(tmp_path / "plan.json", tmp_path / "run", None, "cpu")
    # check_fits=False skips the check (torchrun, stubbed here, would start)
    monkeypatch.setattr(worker, "run_torchrun", lambda *a, **k: None)
    assert worker.launch(tmp_path / "plan.json", tmp_path / "run2", None, "cpu", check_fits=False) is False


def test_fit_check_on_cuda_counts_devices_and_each_ranks_free_memory(plan, monkeypatch):
    import torch

    from trainplan.executor.fit_check import PlanDoesNotFitError, check_fits

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=None: (1 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    mem = dict(plan.predictions.memory_bytes, total=2.0 * gib)
    big = dataclasses.replace(plan, predictions=dataclasses.replace(plan.predictions, memory_bytes=mem))
    two = _capped(big, big.decisions.max_steps, devices=2, dp_degree=2)
    cuda = torch.device("cuda")
    with pytest.raises(PlanDoesNotFitError, match="plan uses 2 devices but torch sees 1 cuda device"):
        check_fits(two, cuda)
    with pytest.raises(PlanDoesNotFitError, match=r"2.00 GiB per device .* cuda:0 has 1.00 GiB free of 80.00 GiB"):
        check_fits(big, cuda)
    with pytest.raises(PlanDoesNotFitError, match="1.00 GiB free"):
        check_fits(two, cuda, in_worker=True)  # a rank checks its own device
    check_fits(plan, cuda)  # the tiny plan fits


def test_fit_check_refuses_decisions_edited_after_the_predictions(plan):
    """The memory checked is the plan's prediction: a micro-batch edited without solving again
    (the predictions kept) is refused before anything is built, on any device."""
    import torch

    from trainplan.errors import PlanMismatchError
    from trainplan.executor.fit_check import check_fits

    edited = dataclasses.replace(plan, decisions=dataclasses.replace(plan.decisions, micro_batch=100000))
    n = len(plan.decisions.activation_checkpoint)  # an edit that keeps tokens per step: Predictions.made_for
    full = dataclasses.replace(plan, decisions=dataclasses.replace(plan.decisions, activation_checkpoint=("full",) * n,
                                                                   optimizer_bits=8))
    for dev in ("cpu", "cuda"):
        with pytest.raises(PlanMismatchError, match="micro_batch=100000 .* edited after the predictions"):
            check_fits(edited, torch.device(dev))
        with pytest.raises(PlanMismatchError,
                           match=r'activation_checkpoint=\["full".* optimizer_bits=8 \(predicted for 32\)'):
            check_fits(full, torch.device(dev))
    old = dataclasses.replace(full, predictions=dataclasses.replace(full.predictions, made_for={}))
    check_fits(old, torch.device("cpu"))  # a plan written before made_for: not checked


def test_a_seconds_budget_stops_the_run_at_its_wall_clock(plan, corpus, tmp_path, torch_threads, monkeypatch):
    """Issue #40, item 15: a plan budgeted in seconds has its steps planned from predicted step
    times; on a slower (or loaded) machine it must still stop on time. With a fake clock that
    advances 1 s per reading, a 3.5 s budget of a 12-step plan stops at the first step boundary
    past it (step 4), says so, and measures the held-out loss there."""
    import trainplan.executor.train as train

    ticks = iter(range(10**6))
    monkeypatch.setattr(train, "wall_clock", lambda: float(next(ticks)))
    budgeted = dataclasses.replace(_capped(plan, 12), budget={**plan.budget, "wall_clock_s": 3.5})
    with torch_threads(1):
        rec = run(budgeted, data=corpus, out=tmp_path / "run", device="cpu", progress=False, checkpoint_every=0)
    assert (rec.stop_reason, rec.steps) == ("budget", 4), (rec.stop_reason, rec.steps)
    assert rec.heldout_loss[-1][0] == 4 and math.isfinite(rec.final_heldout_loss), rec.heldout_loss
    assert any("wall-clock budget of 3.5 s reached after 4 of 12 planned steps" in n for n in rec.notes), rec.notes
    unbudgeted = dataclasses.replace(_capped(plan, 5), budget={**plan.budget, "wall_clock_s": None})
    with torch_threads(1):
        full = run(unbudgeted, data=corpus, out=tmp_path / "run2", device="cpu", progress=False, checkpoint_every=0)
    assert (full.stop_reason, full.steps) == ("budget", 5)


def test_a_run_forecasts_its_own_final_loss_after_each_evaluation(plan, corpus, tmp_path, torch_threads):
    """The run as its own pilot (`trainplan.executor.reporting.forecast`): a forecast after each
    held-out evaluation once the curve has enough points, each the one `replay_forecast` makes
    from the record cut at that step (what the benchmarks recompute from older records), and the
    report's rows for 10/30/50% of the steps."""
    from trainplan.executor.reporting.compare import compare
    from trainplan.executor.reporting.forecast import replay_forecast

    steps = 60
    p = _capped(plan, steps)
    with torch_threads(1):
        rec = run(p, data=corpus, out=tmp_path, device="cpu", progress=False, eval_every=5,
                  eval_tokens=MICRO_BATCH * SEQ_LEN, checkpoint_every=0)
    assert rec.stop_reason == "budget" and rec.steps == steps
    evals = {s for s, _, _ in rec.heldout_loss}
    assert len(rec.loss_forecast) >= 8 and {s for s, _, _ in rec.loss_forecast} <= evals, rec.loss_forecast
    assert all(math.isfinite(f) and b > 0 for _, f, b in rec.loss_forecast)
    for s, f, b in rec.loss_forecast[::3]:
        assert replay_forecast(p, rec, s / steps) == pytest.approx((s, f, b), rel=1e-9)
    assert RunRecord.from_json(tmp_path / "record.json").loss_forecast == rec.loss_forecast
    rows = compare(p, rec).set_index("term")
    assert rows.loc["final_loss_at_30pct", "measured"] == rec.final_heldout_loss
    assert rows.loc["final_loss_at_30pct", "predicted"] == next(f for s, f, _ in reversed(rec.loss_forecast)
                                                                 if s <= 0.3 * steps)
