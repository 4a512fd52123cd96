"""trainplan calibrate on accelerator runs (`trainplan.executor.calibrate.gpu`), without an accelerator: the
records are made from a known profile (h200 with its efficiencies, per-op overhead and memory
reserve changed) by the same step model, and the refit must recover that profile from h200."""

from __future__ import annotations

import pytest

import trainplan.planner.cli.main as cli
from trainplan.costmodels.step.model import Choice
from trainplan.errors import TrainplanError
from trainplan.executor.calibrate.calibration import calibrate
from trainplan.executor.calibrate.gpu import GpuObservation, fit_gpu_profile
from trainplan.executor.calibrate.gpu_parts import PartsPredictor
from trainplan.executor.record import RunRecord
from trainplan.hardware_profiles import HardwareProfile, load
from trainplan.planner.api import plan_for_choice
from trainplan.planner.capture.setup import capture_model

GIB = 2**30
MODEL, VOCAB, PRECISION = "tiny-llama", 8192, "bf16-mixed"
SCALE = {"matmul": 0.6, "memory": 0.85, "network": 0.5}
TRUE_OVERHEAD_S = 2e-5
SHAPES = [dict(micro_batch=2, seq_len=256, activation_checkpoint="none"), dict(micro_batch=4, seq_len=512,
                                                                               activation_checkpoint="full")]


@pytest.fixture(scope="module")
def captured():
    graph, _, numels = capture_model(MODEL, PRECISION, vocab_size=VOCAB)
    return graph, numels


def true_profile(base: HardwareProfile) -> HardwareProfile:
    return base.with_calibration(
        matmul_efficiency=tuple((f, e * SCALE["matmul"]) for f, e in base.matmul_efficiency),
        memory_efficiency=base.memory_efficiency * SCALE["memory"],
        network_efficiency=base.network_efficiency * SCALE["network"], op_overhead_s=TRUE_OVERHEAD_S)


def synthetic_run(tmp_path, captured, shape: dict, truth: HardwareProfile, name: str):
    """A run folder: the plan for h200, the record as `truth` predicts the step (device seconds
    by kind; wall = busy + ops x its per-op overhead; 3 GiB held beyond the predicted peak)."""
    plan = plan_for_choice(MODEL, "h200", devices=2, zero_stage=3, precision=PRECISION, vocab_size=VOCAB,
                           max_steps=12, **shape)
    graph, numels = captured
    parts = PartsPredictor(graph, numels, Choice.from_decisions(plan.decisions)).parts(truth, memory=True)
    busy = parts.matmul_s + parts.other_s + 0.25 * parts.comm_s  # most communication hidden
    wall = busy + parts.n_ops * TRUE_OVERHEAD_S
    peak = parts.peak_bytes
    hbm = truth.hbm_bytes
    rec = RunRecord(model=MODEL, hw_planned="h200", device="cuda:0 (NVIDIA H200)", same_hardware=True, world_size=2,
                    steps=12, step_times_s=[3 * wall, 2 * wall] + [wall] * 7,
                    kernel_time_s={"matmul": parts.matmul_s, "other": parts.other_s,
                                   "communication": parts.comm_s, "busy": busy, "wall": 1.2 * wall, "steps": 2.0},
                    step_max_allocated_bytes=[peak + 0.2 * GIB] * 9, step_max_reserved_bytes=[peak + 1.3 * GIB] * 9,
                    device_memory_bytes={"total": hbm - 1.0 * GIB, "used": peak + 2.0 * GIB,
                                         "reserved": peak + 1.3 * GIB})
    d = tmp_path / name
    d.mkdir()
    plan.to_json(d / "plan.json")
    rec.to_json(d / "record.json")
    return d


@pytest.fixture
def runs(tmp_path, captured):
    truth = true_profile(load("h200"))
    return [synthetic_run(tmp_path, captured, shape, truth, f"run{i}") for i, shape in enumerate(SHAPES)]


def test_walk_splits_exactly_the_models_compute(captured):
    graph, numels = captured
    plan = plan_for_choice(MODEL, "h200", devices=2, zero_stage=3, precision=PRECISION, vocab_size=VOCAB, **SHAPES[1])
    pred = PartsPredictor(graph, numels, Choice.from_decisions(plan.decisions))
    sm = pred.step_model(load("h200"))
    cost = sm.runtime(pred.choice)
    mm, other = pred.roofline_split(sm)
    assert mm > 0 and other > 0
    assert mm + other == pytest.approx(cost.compute_s + cost.recompute_s, rel=1e-9)
    parts = pred.parts(load("h200"))
    assert parts.matmul_s + parts.other_s == pytest.approx(cost.compute_s + cost.recompute_s + cost.optimizer_s)
    assert parts.comm_s > 0 and parts.n_ops > 0


def test_refit_recovers_the_true_profile(runs, tmp_path, capsys):
    base = load("h200")
    res = calibrate(runs, capture_model=capture_model, cache_dir=tmp_path / "cache")
    fit = res.gpu
    assert fit is not None
    assert fit.compute == pytest.approx(SCALE["matmul"], rel=0.01)
    assert fit.memory == pytest.approx(SCALE["memory"], rel=0.01)
    assert fit.network == pytest.approx(SCALE["network"], rel=0.01)
    written = HardwareProfile.from_file(res.gpu_profile_path)
    assert res.gpu_profile_path == runs[0] / "h200-calibrated.toml"
    assert written == fit.profile and written.name == "h200"
    for (f, e), (f0, e0) in zip(written.matmul_efficiency, base.matmul_efficiency, strict=True):
        assert f == f0 and e == pytest.approx(e0 * SCALE["matmul"], rel=0.01)
    assert written.memory_efficiency == pytest.approx(base.memory_efficiency * SCALE["memory"], rel=0.01)
    assert written.network_efficiency == pytest.approx(base.network_efficiency * SCALE["network"], rel=0.01)
    assert written.op_overhead_s == pytest.approx(TRUE_OVERHEAD_S, rel=0.01)
    assert written.memory_reserve_bytes == pytest.approx(3.0 * GIB, rel=0.01)  # 1 + (2 - 1.3) + 1.3 GiB
    assert written.peak_flops_per_s == base.peak_flops_per_s
    assert "calibrated by trainplan calibrate on 2 accelerator run(s)" in written.sources["matmul_efficiency"]
    for row in fit.rows:  # after the refit, the predictions match what was measured
        for kind, attr in (("matmul", "matmul_s"), ("other", "other_s"), ("communication", "comm_s")):
            assert getattr(row.after, attr) == pytest.approx(row.measured[kind], rel=1e-3)
    out = capsys.readouterr().out
    assert "h200 profile (accelerator runs): compute x0.6" in out and "--hw" in out
    assert "loss law not refit" in out  # no held-out curve: a note, not an error, for accelerator runs


def test_calibrating_again_with_the_written_profile_changes_nothing(runs, tmp_path):
    first = calibrate(runs, capture_model=capture_model, cache_dir=tmp_path / "cache", verbose=False)
    again = calibrate(runs, capture_model=capture_model, cache_dir=tmp_path / "cache", verbose=False,
                      hw=str(first.gpu_profile_path), profile_out=tmp_path / "again.toml")
    assert again.gpu.compute == pytest.approx(1.0, rel=1e-6)
    assert again.gpu.memory == pytest.approx(1.0, rel=1e-6)
    assert again.gpu.network == pytest.approx(1.0, rel=1e-6)
    assert HardwareProfile.from_file(tmp_path / "again.toml").memory_reserve_bytes == pytest.approx(
        first.gpu.profile.memory_reserve_bytes, rel=1e-6)


def test_efficiency_above_one_goes_onto_the_peaks(tmp_path, captured):
    base = load("h200")  # matmul plateau 0.8: x1.5 would be 1.2
    truth = base.with_calibration(peak_flops_per_s={k: 1.5 * v for k, v in base.peak_flops_per_s.items()})
    d = synthetic_run(tmp_path, captured, SHAPES[0], truth, "fast")
    graph, numels = captured
    from trainplan.executor.calibrate.runs import load_run_folder

    run = load_run_folder(d)
    obs = GpuObservation(run_dir=str(d), record=run.record,
                         predictor=PartsPredictor(graph, numels, Choice.from_decisions(run.plan.decisions)))
    fit = fit_gpu_profile(base, [obs])
    assert fit.compute == pytest.approx(1.5, rel=0.01)
    assert fit.profile.matmul_efficiency == base.matmul_efficiency
    assert fit.profile.peak("bf16") == pytest.approx(1.5 * base.peak("bf16"), rel=0.01)
    assert "peak_flops_per_s" in fit.fields


def test_runs_without_a_kernel_split_refit_nothing(tmp_path, runs):
    rec = RunRecord.from_json(runs[0] / "record.json")
    rec.kernel_time_s = None
    rec.to_json(runs[0] / "record.json")
    res = calibrate(runs[:1], capture_model=capture_model, cache_dir=tmp_path / "cache", verbose=False)
    assert res.gpu is None and res.gpu_profile_path is None
    assert any("no kernel time split" in n for n in res.notes)
    assert any("no run refits the 'h200' profile" in n for n in res.notes)
    with pytest.raises(TrainplanError, match="no run has a kernel time split"):
        fit_gpu_profile(load("h200"), [])


def test_runs_planned_for_two_profiles_need_hw(tmp_path, runs):
    """A run planned for h100 beside h200 runs (its plan's memory limit an h100's, as a plan solved for
    one has), then one planned with a profile file (the plan records the file, as `solve --hw
    FILE.toml` writes it): `trainplan.planner.plan.implausible` accepts both plans."""
    import json

    from trainplan.hardware_profiles import load

    raw = json.loads((runs[1] / "plan.json").read_text())
    limit = min(raw["predictions"]["memory_limit_bytes"], float(load("h100").hbm_bytes))
    raw = raw | {"hw": "h100", "predictions": raw["predictions"] | {"memory_limit_bytes": limit}}
    (runs[1] / "plan.json").write_text(json.dumps(raw))
    with pytest.raises(TrainplanError, match="planned for 'h100', 'h200': refit one profile at a time"):
        calibrate(runs, capture_model=capture_model, cache_dir=tmp_path / "cache", verbose=False)
    raw = raw | {"hw": "my-gpu", "options": (raw.get("options") or {}) | {"hw_profile_file": "my-gpu.toml"}}
    (runs[1] / "plan.json").write_text(json.dumps(raw))
    with pytest.raises(TrainplanError, match="give that file with --hw FILE.toml"):
        calibrate(runs[1:], capture_model=capture_model, cache_dir=tmp_path / "cache", verbose=False)


def test_cli_profile_out_must_be_a_file_in_a_folder(tmp_path, runs, capsys):
    for bad in (str(tmp_path), str(tmp_path / "missing" / "x.toml")):
        assert cli.main(["calibrate", str(runs[0]), "--profile-out", bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("trainplan: error: --profile-out") and err.count("\n") == 1
    assert not list(runs[0].glob("*.toml"))  # refused before anything was fitted or written
