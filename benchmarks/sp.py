"""Ulysses sequence parallelism on this machine's CPU: per-rank memory, step time and loss
against the predictions, for SP degree 1, 2 and 4.

For each case (sequence length, SP degree P, ZeRO stage) it makes a plan with those knobs fixed
(`trainplan.planner.api.plan_for_choice`, `tiny-llama`: 8 heads, 4 kv heads; P devices, all of them in one
SP group, so dp = 1 and every case trains on the same batches from the same initial weights),
runs it with the real executor (P = 1 in this process; P > 1 under torchrun through
`trainplan.executor.worker.launch`, gloo; one torch thread per rank everywhere, and the step-time
predictions use the `cpu` profile measured with one thread) and compares:

- per-rank peak tensor memory (MemTracker, `RunRecord.per_rank_peak_bytes`) against the plan's
  predicted per-device peak (`predictions.memory_bytes["total"]`); rank 0's categories beside
  the predicted ones;
- median step time after warm-up against the predicted step time (a device is one core; on a
  2-core machine SP 4 runs two ranks per core, so expect it about 2x slower than predicted;
  the ratio to SP 1 is reported beside the prediction's);
- the train loss at every step against SP 1 at the same sequence length (same data, same
  init): |loss_P - loss_1| / loss_1.

    python benchmarks/sp.py [--quick | --smoke] [--out DIR]

`--smoke`: SP 1 and SP 2 (ZeRO 0) at 128 tokens, the same code path (one process and torchrun)
and output files; for the test suite.

Writes DIR/sp.csv (one row per case) and DIR/sp.json (summary); runs under DIR/runs/sp/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

MODEL = "tiny-llama"
VOCAB = 8192
MICRO_BATCH = 1
STEPS = 8  # 2 warm-up, 1 MemTracker, 1 FlopCounterMode, 4 timed (2 after warm-up)
CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries")


def grid(quick: bool, smoke: bool = False) -> list[dict]:
    """Cases: for each sequence length SP 1 (one process), then SP 2 and 4 at each ZeRO stage;
    `smoke`: SP 1 and SP 2 at 128 tokens (the SP 2 loss is compared with SP 1's).

    Sequence lengths are long enough that activations, not model states, set the peak at SP 1
    (tiny-llama's model states are ~100 MiB in fp32 with Adam; its activations ~57 MiB per 512
    tokens), so the peak moves from activations to model states as P grows."""
    if smoke:
        return [dict(seq_len=128, sp_degree=1, zero_stage=0), dict(seq_len=128, sp_degree=2, zero_stage=0)]
    seqs, zeros = ((512,), (0, 3)) if quick else ((512, 1024, 2048), (0, 2, 3))
    cases = []
    for s in seqs:
        cases.append(dict(seq_len=s, sp_degree=1, zero_stage=0))
        cases += [dict(seq_len=s, sp_degree=p, zero_stage=z) for p in (2, 4) for z in zeros]
    return cases


def use_one_thread_per_rank(root: Path, smoke: bool = False) -> None:
    """Make this process and its torchrun workers alike: one torch thread each, one private
    trainplan cache (`root`) holding the 1-thread cpu profile the predictions use.

    The cpu profile cache holds one entry keyed by the thread count runs use (OMP_NUM_THREADS,
    else all cores: `trainplan.hardware_profiles.threads`); with OMP_NUM_THREADS=1 set here the profile is
    measured at one thread and every rank runs at one. With one thread everywhere a
    "device" is one core for SP 1 and 2 (SP 4 puts two ranks on each of 2 cores), the profile is
    measured once, and the user's cache is untouched. The tokenizer and token caches are
    linked from the user's cache. `smoke`: the profile is measured with the quick probes
    (`measure_cpu(quick=True)`, seconds instead of ~25 s) and saved there first."""
    from trainplan.hardware_profiles.cache import cache_root

    src = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    for sub in ("tokenizers", "tokens"):
        if (src / sub).exists() and not (root / sub).exists():
            (root / sub).symlink_to((src / sub).resolve(), target_is_directory=True)
    os.environ["TRAINPLAN_CACHE_DIR"] = str(root)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if smoke:
        from trainplan.hardware_profiles.cpu import measure_cpu, save_profile

        save_profile(measure_cpu(quick=True))


def run_case(case: dict, out: Path, smoke: bool = False):
    """Plan and run one case; returns (plan, record, wall seconds including launch, run dir).
    `smoke`: one held-out evaluation of one micro-batch, at the last step (the default evaluates
    16,384 tokens every step of these 8-step runs; this benchmark reads only the train loss)."""
    from trainplan.executor.reporting.report import load_run
    from trainplan.executor.train import run
    from trainplan.executor.worker import launch
    from trainplan.planner.api import plan_for_choice

    p = case["sp_degree"]
    plan = plan_for_choice(MODEL, "cpu", seq_len=case["seq_len"], micro_batch=MICRO_BATCH,
                           sp_degree=p, devices=p, zero_stage=case["zero_stage"],
                           max_steps=STEPS, vocab_size=VOCAB)
    run_dir = out / "runs" / "sp" / "s{seq_len}_sp{sp_degree}_zero{zero_stage}".format(**case)
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    plan.to_json(run_dir / "plan.json")
    t0 = time.perf_counter()
    evals = dict(eval_every=STEPS, eval_tokens=case["seq_len"] * MICRO_BATCH) if smoke else {}
    if p > 1:
        launch(run_dir / "plan.json", run_dir, None, None, **evals)
        plan, record = load_run(run_dir)
    else:
        record = run(plan, out=run_dir, progress=False, **evals)
    return plan, record, time.perf_counter() - t0, run_dir


def _rel(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas else float("nan")


def case_row(case: dict, plan, record, wall_s: float, run_dir: Path) -> dict:
    """One CSV row: predicted and measured side by side (bytes, FLOPs, seconds)."""
    pred = plan.predictions
    per_rank = list(record.per_rank_peak_bytes) or [record.peak_memory_bytes.get("total", 0.0)]
    total_pred = pred.memory_bytes["total"]
    errs = [_rel(total_pred, m) for m in per_rank]
    row = dict(case, micro_batch=MICRO_BATCH, world_size=record.world_size,
               predicted_phase=pred.memory_phase,
               peak_memory_predicted=total_pred,
               peak_memory_measured_max_rank=max(per_rank),
               peak_memory_measured_min_rank=min(per_rank),
               per_rank_peak_memory_max_abs_rel_err=max(abs(e) for e in errs),
               per_rank_peak_memory_rel_err_rank0=errs[0],
               per_rank_peak_bytes=json.dumps(per_rank))
    for cat in CATEGORIES:
        row[f"{cat}_predicted"] = pred.memory_bytes.get(cat, float("nan"))
        row[f"{cat}_measured_rank0"] = record.peak_memory_bytes.get(cat, float("nan"))
    row.update(flops_per_step_predicted=pred.flops_per_step,
               flops_per_step_measured_rank0=record.flops_per_step,
               flops_per_step_rel_err=_rel(pred.flops_per_step, record.flops_per_step),
               step_time_predicted=pred.step_time_s,
               step_time_measured=record.median_step_time_s,
               step_time_rel_err=_rel(pred.step_time_s, record.median_step_time_s),
               train_loss=json.dumps([round(loss, 6) for _, loss in record.train_loss]),
               steps=record.steps, stop_reason=record.stop_reason, wall_s=wall_s,
               run_dir=str(run_dir))
    return row


def add_loss_diffs(df: pd.DataFrame) -> pd.DataFrame:
    """Per case: max over steps of |loss_P - loss_1| / loss_1 against SP 1 at the same length;
    and the measured step-time ratio to SP 1 beside the predicted ratio."""
    df = df.copy()
    diffs, t_meas, t_pred = [], [], []
    for _, r in df.iterrows():
        base = df[(df["seq_len"] == r["seq_len"]) & (df["sp_degree"] == 1)]
        if base.empty:
            diffs.append(float("nan")), t_meas.append(float("nan")), t_pred.append(float("nan"))
            continue
        b = base.iloc[0]
        ref, mine = json.loads(b["train_loss"]), json.loads(r["train_loss"])
        n = min(len(ref), len(mine))
        diffs.append(max(abs(x - y) / abs(y) for x, y in zip(mine[:n], ref[:n], strict=False)) if n else float("nan"))
        t_meas.append(r["step_time_measured"] / b["step_time_measured"])
        t_pred.append(r["step_time_predicted"] / b["step_time_predicted"])
    df["loss_max_rel_diff_vs_sp1"] = diffs
    df["step_time_ratio_vs_sp1_measured"] = t_meas
    df["step_time_ratio_vs_sp1_predicted"] = t_pred
    return df


def summarize(df: pd.DataFrame, quick: bool, smoke: bool = False) -> dict:
    """The flat summary written to sp.json."""
    def mx(col, rows=df):
        xs = rows[col].dropna().abs()
        return float(xs.max()) if len(xs) else float("nan")

    def med(col, rows=df):
        xs = rows[col].dropna().abs()
        return float(xs.median()) if len(xs) else float("nan")

    multi = df[df["sp_degree"] > 1]
    summary = {
        "cases": int(len(df)),
        "per_rank_peak_memory_max_rel_err": mx("per_rank_peak_memory_max_abs_rel_err"),
        "per_rank_peak_memory_median_rel_err": med("per_rank_peak_memory_max_abs_rel_err"),
    }
    for z in sorted(df["zero_stage"].unique()):
        summary[f"per_rank_peak_memory_max_rel_err_zero{z}"] = mx(
            "per_rank_peak_memory_max_abs_rel_err", df[df["zero_stage"] == z])
    summary.update({
        "sp_loss_max_rel_diff": mx("loss_max_rel_diff_vs_sp1", multi),
        "flops_max_rel_err": mx("flops_per_step_rel_err"),
        "step_time_median_rel_err_sp1": med("step_time_rel_err", df[df["sp_degree"] == 1]),
        "step_time_median_rel_err_sp_gt1": med("step_time_rel_err", multi),
        "all_runs_completed": bool((df["stop_reason"] == "budget").all()
                                   and (df["steps"] == STEPS).all()),
        "quick": quick,
        "smoke": smoke,
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                   f"{os.cpu_count()} cores, {torch.get_num_threads()} torch thread per rank",
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    })
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller grid, about three minutes")
    ap.add_argument("--smoke", action="store_true", help="SP 1 and 2 at 128 tokens, for the test suite")
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(tempfile.mkdtemp(prefix="trainplan-sp-cache-"))
    old_cache = os.environ.get("TRAINPLAN_CACHE_DIR")
    use_one_thread_per_rank(cache, a.smoke)
    rows = []
    t_all = time.perf_counter()
    try:
        for i, case in enumerate(grid(a.quick, a.smoke)):
            plan, record, wall, run_dir = run_case(case, out, a.smoke)
            row = case_row(case, plan, record, wall, run_dir)
            rows.append(row)
            mib = 2**20
            print(f"[{i + 1}] seq {case['seq_len']} sp {case['sp_degree']} zero {case['zero_stage']}: "
                  f"peak/rank predicted {row['peak_memory_predicted'] / mib:.1f} MiB, measured "
                  f"{row['peak_memory_measured_max_rank'] / mib:.1f} MiB "
                  f"({row['per_rank_peak_memory_rel_err_rank0']:+.1%}); step "
                  f"{row['step_time_predicted']:.3f} s vs {row['step_time_measured']:.3f} s; "
                  f"{wall:.0f} s", flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        if old_cache is None:
            os.environ.pop("TRAINPLAN_CACHE_DIR", None)
        else:
            os.environ["TRAINPLAN_CACHE_DIR"] = old_cache
    df = add_loss_diffs(pd.DataFrame(rows))
    df.to_csv(out / "sp.csv", index=False)
    summary = summarize(df, a.quick, a.smoke)
    summary["wall_s"] = time.perf_counter() - t_all
    (out / "sp.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
