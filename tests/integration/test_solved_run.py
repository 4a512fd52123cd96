"""A solved plan whose blocks use CP-SAT checkpoint sets (`remat:k`) runs end to end, and its
measured peak memory and FLOPs match the prediction."""

import dataclasses
import math

import torch

from trainplan.executor.data.batches import load_corpus
from trainplan.executor.train import run
from trainplan.planner import Budget, solve
from trainplan.planner.api import plan_for_choice

TEXT = "\n".join(f"Line {i}: to be or not to be, that is the question {i % 7}." for i in range(4000))


def test_solved_checkpoint_sets_run_and_match(tmp_path, cpu_profile):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    data = load_corpus([path], vocab_size=320, cache_dir=tmp_path / "cache")
    case = dict(seq_len=128, micro_batch=4, sp_degree=1, devices=1, zero_stage=0, optimizer_bits=32)
    peak = {ck: plan_for_choice("tiny-llama", cpu_profile, **case, activation_checkpoint=ck,
                                vocab_size=data.vocab_size).predictions.memory_bytes["total"]
            for ck in ("none", "full")}
    cap = peak["full"] + 0.5 * (peak["none"] - peak["full"])
    plan = solve("tiny-llama", cpu_profile, Budget(wall_clock_s=60), seq_len=128,
                 vocab_size=data.vocab_size, micro_batches=(4,), optimizer_bits=(32,),
                 memory_limit_bytes=cap)
    entries = plan.decisions.activation_checkpoint
    assert any(p.startswith("remat:") for p in entries), entries
    assert plan.predictions.memory_bytes["total"] <= cap
    plan = dataclasses.replace(plan, decisions=dataclasses.replace(  # 5 steps, the warm-up within them
        plan.decisions, max_steps=5, warmup_steps=min(plan.decisions.warmup_steps, 5)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rec = run(plan, data=data, out=tmp_path / "run", progress=False, checkpoint_every=0)
    finally:
        torch.set_num_threads(threads)
    pred, meas = plan.predictions.memory_bytes["total"], rec.peak_memory_bytes["total"]
    assert math.isclose(pred, meas, rel_tol=0.03), f"predicted {pred:.0f} B, measured {meas:.0f} B"
    assert plan.predictions.flops_per_step == rec.flops_per_step, (
        f"predicted {plan.predictions.flops_per_step:.0f} FLOPs, measured {rec.flops_per_step:.0f}")
    # calibration re-predicts a run's step time from its plan, solved sets included
    from trainplan.executor.calibrate.runs import load_run_folder
    from trainplan.executor.calibrate.step_time import StepTimePredictor
    from trainplan.planner.capture.setup import capture_model

    if not (tmp_path / "run" / "plan.json").exists():
        plan.to_json(tmp_path / "run" / "plan.json")
    again = StepTimePredictor(load_run_folder(tmp_path / "run"), {}, capture_model).time(cpu_profile)
    assert math.isclose(again, plan.predictions.step_time_s, rel_tol=1e-6), (again, plan.predictions.step_time_s)
