"""trainplan.executor.calibrate: loss-law refit, cpu step-time refit, errors, and solve() using the law.

No training: plans and records are built by hand; the cpu profile is a synthetic one saved into
a temporary cache (so nothing is measured and the user's cache is untouched)."""

from __future__ import annotations

import numpy as np
import pytest

import trainplan.hardware_profiles
from trainplan.costmodels.loss.cache import (
    law_from_fields,
    law_path,
    load_local_law,
    read_local_law_file,
    save_local_law,
)
from trainplan.costmodels.loss.law import LossLaw
from trainplan.costmodels.loss.planned import run_loss
from trainplan.costmodels.step.model import Choice, StepModel
from trainplan.errors import TrainplanError
from trainplan.executor.calibrate.calibration import calibrate
from trainplan.executor.calibrate.law import SKIP_FRACTION
from trainplan.executor.calibrate.step_time import scaled_profile
from trainplan.executor.record import RunRecord
from trainplan.hardware_profiles import HardwareProfile
from trainplan.planner.api import solve
from trainplan.planner.budget import Budget
from trainplan.planner.capture.setup import capture_model
from trainplan.planner.plan import Decisions, Plan, Predictions, SolverFacts

GIB = 2**30
MODEL, VOCAB, LAYERS = "tiny-llama", 8192, 4
TRUE = dict(E=3.5, B=60.0, beta=0.3)


def fake_cpu(**over) -> HardwareProfile:
    fields = dict(
        name="cpu", vendor="test", device_type="cpu", source="synthetic test profile",
        hbm_bytes=16 * GIB, hbm_bandwidth_bytes_per_s=1e10,
        peak_flops_per_s={"fp32": 5e10, "tf32": 5e10, "bf16": 5e10, "fp16": 5e10},
        intra_node_bandwidth_bytes_per_s=1e10, inter_node_bandwidth_bytes_per_s=1e9,
        devices_per_node=1, memory_reserve_bytes=4 * GIB,
        matmul_efficiency=((1e5, 0.2), (1e8, 0.5), (1e10, 0.8)), memory_efficiency=0.8,
        sources={"matmul_efficiency": "test curve"})
    fields.update(over)
    return HardwareProfile(**fields)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Temporary cache with the synthetic cpu profile; the in-process cpu memo is isolated."""
    monkeypatch.setenv("TRAINPLAN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(trainplan.hardware_profiles.cpu, "_MEMO", {})
    trainplan.hardware_profiles.cpu.save_profile(fake_cpu())
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def graph():
    g, _, numels = capture_model(MODEL, "fp32", vocab_size=VOCAB)
    return g, numels


def synthetic_curve(n=20, *, noise=0.0, seed=0):
    """(step, tokens, loss) from the true law, the first points spoiled as if in warm-up."""
    rng = np.random.default_rng(seed)
    tokens = np.geomspace(2e4, 2e6, n)
    loss = TRUE["E"] + TRUE["B"] / tokens ** TRUE["beta"]
    loss = loss * (1 + noise * rng.standard_normal(n))
    warm = int(SKIP_FRACTION * n)
    loss[:warm] += 2.0  # warm-up points far off the law: must be skipped
    return [(i + 1, int(t), float(x)) for i, (t, x) in enumerate(zip(tokens, loss, strict=False))]


def make_plan(*, n_params=7_096_576, micro_batch=2, seq_len=64, hw="cpu", step_time_s=0.5,
              model=MODEL) -> Plan:
    return Plan(
        model=model, model_n_params=n_params, model_n_layers=LAYERS, hw=hw,
        budget={"wall_clock_s": 60.0, "devices": 1, "seq_len": seq_len}, data_tokens=10**9,
        vocab_size=VOCAB,
        decisions=Decisions(devices=1, sp_degree=1, dp_degree=1, zero_stage=0,
                            micro_batch=micro_batch, seq_len=seq_len, activation_checkpoint=("none",) * LAYERS,
                            precision="fp32", optimizer_bits=32, data_fraction=1.0,
                            data_method="random", max_tokens=2_000_000, max_steps=100,
                            governor_threshold=0.0),
        predictions=Predictions(
            memory_bytes={"total": 1e8}, memory_phase="backward", memory_limit_bytes=12 * GIB,
            step_time_s=step_time_s, step_time_breakdown_s={"compute": step_time_s, "recompute": 0.0,
                                                            "communication": 0.0},
            flops_per_step=1e9, model_flops_per_step=1e9, tokens_per_step=micro_batch * seq_len,
            total_tokens=2_000_000, device_hours=0.01, final_loss=40.0, mfu=0.1),
        solver=SolverFacts(status="OPTIMAL", objective=1.0, bound=1.0, wall_s=0.1, seed=0,
                           time_limit_s=10.0))


def make_record(*, step_s=0.5, heldout=None, same_hardware=True, model=MODEL) -> RunRecord:
    return RunRecord(model=model, hw_planned="cpu", device="cpu", same_hardware=same_hardware,
                     steps=100, tokens=2_000_000, step_times_s=[9.0, 9.0] + [step_s] * 7,
                     heldout_loss=synthetic_curve() if heldout is None else heldout)


def write_run(path, plan: Plan, record: RunRecord):
    path.mkdir(parents=True)
    plan.to_json(path / "plan.json")
    record.to_json(path / "record.json")
    return path


def predict(profile: HardwareProfile, g, numels, plan: Plan) -> float:
    d = plan.decisions
    model = StepModel(g.regions, g.blocks, numels, profile, n_heads=g.n_heads,
                      n_kv_heads=g.n_kv_heads, head_dim=g.head_dim)
    return model.evaluate(Choice(sp_degree=1, zero_stage=0, micro_batch=d.micro_batch,
                                 seq_len=d.seq_len, policies=d.activation_checkpoint, precision="fp32",
                                 optimizer_bits=32, devices=1)).time_s


# --------------------------------------------------------------------------- loss law


def test_law_recovered_from_synthetic_curve_and_cached(cache, tmp_path, capsys):
    run = write_run(tmp_path / "run", make_plan(), make_record(same_hardware=False))
    res = calibrate([run], capture_model=capture_model)
    (fit,) = res.laws
    law = fit.law
    for k, v in TRUE.items():
        assert getattr(law, k) == pytest.approx(v, rel=0.02), k
    assert law.A == 0.0
    assert fit.n_skipped == 4 and fit.n_points == 16
    assert max(abs(r) for r in fit.residuals) < 1e-3
    # cached where solve() looks, with inputs and residuals
    assert fit.path == law_path(MODEL, VOCAB) == cache / "laws" / f"{MODEL}-v{VOCAB}.json"
    saved = read_local_law_file(fit.path)
    assert len(saved["fit"]["points"]) == 16 and len(saved["fit"]["residuals"]) == 16
    assert {"step", "tokens", "effective_tokens", "loss", "predicted", "residual"} <= set(saved["fit"]["points"][0])
    loaded = load_local_law(MODEL, VOCAB)
    assert loaded == law
    assert "fitted to 16 held-out points of" in loaded.source and "trainplan calibrate" in loaded.source
    # not a cpu run: profile untouched, and said so
    assert res.profile is None and res.step_time == ()
    out = capsys.readouterr().out
    assert "loss law tiny-llama v8192" in out and "cpu profile unchanged" in out


def test_law_fit_with_noise_and_two_runs(cache, tmp_path):
    a = write_run(tmp_path / "a", make_plan(), make_record(heldout=synthetic_curve(noise=0.002, seed=1),
                                                           same_hardware=False))
    b = write_run(tmp_path / "b", make_plan(), make_record(heldout=synthetic_curve(noise=0.002, seed=2),
                                                           same_hardware=False))
    (fit,) = calibrate([a, b], capture_model=capture_model, verbose=False).laws
    assert fit.n_points == 32 and fit.run_dirs == (str(a), str(b))
    assert fit.law.predict(1.0, 2e6) == pytest.approx(TRUE["E"] + TRUE["B"] / 2e6 ** TRUE["beta"], rel=0.01)
    assert fit.rms_rel_err_after < fit.rms_rel_err_before


def test_cache_dir_argument(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINPLAN_CACHE_DIR", str(tmp_path / "elsewhere"))
    run = write_run(tmp_path / "run", make_plan(), make_record(same_hardware=False))
    (fit,) = calibrate([run], capture_model=capture_model, cache_dir=tmp_path / "mine", verbose=False).laws
    assert fit.path == tmp_path / "mine" / "laws" / f"{MODEL}-v{VOCAB}.json"
    assert load_local_law(MODEL, VOCAB) is None
    assert load_local_law(MODEL, VOCAB, cache_dir=tmp_path / "mine") == fit.law


def test_corrupt_law_file_is_ignored_with_a_warning(tmp_path):
    path = law_path(MODEL, VOCAB, tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.warns(RuntimeWarning, match="ignoring local loss law"):
        assert load_local_law(MODEL, VOCAB, tmp_path) is None


# --------------------------------------------------------------------------- step time


@pytest.mark.parametrize("r", [1.7, 0.5])
def test_step_time_refit_matches_measured(cache, tmp_path, graph, r):
    g, numels = graph
    plan = make_plan()
    before = fake_cpu()
    measured = r * predict(before, g, numels, plan)
    run = write_run(tmp_path / "run", plan, make_record(step_s=measured))
    res = calibrate([run], capture_model=capture_model, verbose=False)
    assert res.step_time_method == "ratio" and res.ratio == pytest.approx(r, rel=1e-6)
    after = trainplan.hardware_profiles.load("cpu")
    assert after == res.profile
    # the next prediction is the measured median
    assert predict(after, g, numels, plan) == pytest.approx(measured, rel=0.05)
    (row,) = res.step_time
    assert row.rel_err_before == pytest.approx(r ** -1 - 1, rel=1e-6)
    assert abs(row.rel_err_after) < 1e-6
    if r > 1:  # efficiencies divided by r
        assert [e for _, e in after.matmul_efficiency] == pytest.approx(
            [e / r for _, e in before.matmul_efficiency])
        assert after.memory_efficiency == pytest.approx(before.memory_efficiency / r)
        assert after.peak_flops_per_s == before.peak_flops_per_s
        assert "trainplan calibrate" in after.sources["matmul_efficiency"]
        assert after.sources["matmul_efficiency"].endswith("original: test curve")
    else:  # efficiencies would exceed 1: the peaks and bandwidth carry the factor
        assert after.matmul_efficiency == before.matmul_efficiency
        assert after.peak_flops_per_s["fp32"] == pytest.approx(before.peak_flops_per_s["fp32"] / r)
        assert after.hbm_bandwidth_bytes_per_s == pytest.approx(before.hbm_bandwidth_bytes_per_s / r)
        assert set(res.scaled_fields) == {"peak_flops_per_s", "hbm_bandwidth_bytes_per_s", "op_overhead_s"}
    # calibrating again on the same run does not compound
    again = calibrate([run], capture_model=capture_model, verbose=False)
    assert again.ratio == pytest.approx(1.0, rel=1e-6)


def test_two_shapes_fit_compute_and_memory_separately(cache, tmp_path, graph):
    g, numels = graph
    truth = scaled_profile(fake_cpu(), 0.4, 3.0)  # compute 2.5x slower, memory 3x faster than profiled
    plans = [make_plan(micro_batch=1, seq_len=64), make_plan(micro_batch=16, seq_len=512)]
    runs = [write_run(tmp_path / f"run{i}", p, make_record(step_s=predict(truth, g, numels, p)))
            for i, p in enumerate(plans)]
    res = calibrate(runs, capture_model=capture_model, verbose=False)
    after = trainplan.hardware_profiles.load("cpu")
    for row in res.step_time:
        assert abs(row.rel_err_after) < 0.05, (res.step_time_method, res.step_time)
    assert res.step_time_method == "least-squares"
    assert max(abs(r.rel_err_after) for r in res.step_time) <= max(abs(r.rel_err_before) for r in res.step_time)
    assert after == res.profile


def test_other_hardware_runs_leave_profile_alone(cache, tmp_path):
    run = write_run(tmp_path / "run", make_plan(hw="h100"), make_record(same_hardware=False))
    res = calibrate([run], capture_model=capture_model, verbose=False)
    assert res.profile is None and res.profile_path is None and res.step_time_method == ""
    assert trainplan.hardware_profiles.load("cpu") == fake_cpu()
    assert any("h100" in n for n in res.notes)


# --------------------------------------------------------------------------- errors


def test_missing_run_dir_is_named(cache, tmp_path):
    with pytest.raises(TrainplanError, match="nope.*does not exist"):
        calibrate([tmp_path / "nope"], capture_model=capture_model)


def test_run_dir_without_record_is_named(cache, tmp_path):
    d = tmp_path / "half"
    d.mkdir()
    make_plan().to_json(d / "plan.json")
    with pytest.raises(TrainplanError, match=r"half.*no record\.json"):
        calibrate([d], capture_model=capture_model)


def test_too_few_heldout_points(cache, tmp_path):
    run = write_run(tmp_path / "short", make_plan(), make_record(heldout=synthetic_curve()[:3]))
    with pytest.raises(TrainplanError) as e:
        calibrate([run], capture_model=capture_model)
    msg = str(e.value)
    assert "short" in msg and "3 held-out points found" in msg and "at least 4" in msg
    # nothing written: neither a law nor a changed profile
    assert not law_path(MODEL, VOCAB).exists()
    assert trainplan.hardware_profiles.load("cpu") == fake_cpu()


# --------------------------------------------------------------------------- solve


def test_solve_uses_cached_law_on_cpu(cache):
    law = LossLaw(E=3.5, A=0.0, B=60.0, beta=0.3,
                  source="fitted to 16 held-out points of runs/demo (trainplan calibrate)")
    save_local_law(law, model=MODEL, vocab_size=VOCAB)
    plan = solve(MODEL, "cpu", Budget(wall_clock_s=5), seq_len=64, time_limit_s=5.0)
    assert f"loss law: {law.source}" in plan.notes
    used = law_from_fields(plan.predictions.loss_law)  # the cached law, with the model's vocabulary (ln V bound)
    assert (used.E, used.B, used.beta, used.vocab_size) == (law.E, law.B, law.beta, VOCAB)
    expected = run_loss(used, plan.model_n_params, steps=plan.decisions.max_steps,
                        tokens_per_step=plan.predictions.tokens_per_step, warmup_steps=plan.decisions.warmup_steps,
                        unique_tokens=plan.decisions.data_fraction * plan.data_tokens)
    assert plan.predictions.final_loss == pytest.approx(expected, rel=0.01)  # solver's token grid
    published = LossLaw.besiroglu2024().predict(plan.model_n_params, plan.predictions.total_tokens)
    assert abs(plan.predictions.final_loss - published) > 1.0
    # an explicit law still wins
    explicit = solve(MODEL, "cpu", Budget(wall_clock_s=5), seq_len=64, time_limit_s=5.0,
                     law=LossLaw.hoffmann2022())
    assert any("Hoffmann" in n for n in explicit.notes)
