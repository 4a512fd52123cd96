"""Accuracy of trainplan's predictions against real runs on this machine's CPU.

For each configuration of a grid (sequence length, micro-batch, checkpoint set, SP degree, ZeRO
stage, optimizer bits) it makes a plan with those knobs fixed (`trainplan.planner.api.plan_for_choice`),
runs it with the real executor for a few steps, and compares predicted and measured peak
memory (MemTracker), FLOPs (FlopCounterMode) and step time (median after warm-up).

    python benchmarks/accuracy.py [--quick | --smoke] [--out DIR]

`--smoke`: one case (the solver-planned checkpoint set, single process, the path `--quick`
once crashed on), the same code path and output files; for the test suite.

Writes DIR/accuracy.csv (one row per configuration) and DIR/accuracy.json (summary: median and
maximum relative error of each term). Single-process runs use `--threads` torch threads
(default 1), multi-process runs one per rank. A single-process step at one thread is measured
by its process CPU time (`RunRecord.step_cpu_times_s`): on a machine other jobs share, wall time
measures their load too, CPU time does not; multi-process steps (which wait on each other) by
wall time. Both are in the CSV (`step_time_wall_measured`, `step_time_cpu_measured`). Step time is reported
twice: with the cpu profile as
measured, and after calibrating it (`trainplan calibrate`'s method, in a scratch cache) on the
even-numbered single-process cases, then predicting the odd-numbered ones (held out).
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import platform
import shutil
import statistics
import sys
from pathlib import Path

import pandas as pd
import torch

from trainplan.costmodels.loss.planned import warmup_steps_for
from trainplan.executor.data.batches import load_corpus
from trainplan.executor.reporting.compare import compare
from trainplan.planner.api import plan_for_choice, solve
from trainplan.planner.budget import Budget

STEPS = 9  # 2 warm-up, 1 MemTracker, 1 FlopCounterMode, 5 timed


def grid(quick: bool, multi: bool = True, smoke: bool = False) -> list[dict]:
    """The configurations: single-process product plus SP/ZeRO runs over 2 processes (`multi`:
    off on a single accelerator); `smoke`: one single-process case with solver-planned sets."""
    if smoke:
        return [dict(seq_len=128, micro_batch=2, activation_checkpoint="planned", sp_degree=1, devices=1,
                     zero_stage=0, optimizer_bits=32)]
    seqs, mbs = ((128,), (2, 4)) if quick else ((128, 256), (2, 4))
    ckpts = ("none", "full", "planned")
    bits = (32, 8)
    cases = [dict(seq_len=s, micro_batch=b, activation_checkpoint=c, sp_degree=1, devices=1, zero_stage=0,
                  optimizer_bits=o) for s, b, c, o in itertools.product(seqs, mbs, ckpts, bits)]
    pairs = [(2, 2, 0), (2, 2, 3), (2, 1, 2), (2, 2, 2)] if not quick else [(2, 2, 0), (2, 1, 2)]
    for devices, sp, zero in pairs if multi else []:
        cases.append(dict(seq_len=128, micro_batch=2, activation_checkpoint="full" if zero == 3 else "none",
                          sp_degree=sp, devices=devices, zero_stage=zero, optimizer_bits=32))
    return cases


HW, DEVICE, PRECISION = "cpu", None, "fp32"  # set from the command line


def planned_plan(case: dict, vocab: int):
    """The solver's plan with memory capped halfway between full checkpointing's peak and no
    checkpointing's, its knobs but the checkpoint sets pinned to the case, run for STEPS steps."""
    import dataclasses

    peak = {ck: plan_for_choice("tiny-llama", HW, **{**case, "activation_checkpoint": ck}, precision=PRECISION,
                                vocab_size=vocab).predictions.memory_bytes["total"]
            for ck in ("none", "full")}
    cap = peak["full"] + 0.5 * (peak["none"] - peak["full"])
    plan = solve("tiny-llama", HW, Budget(wall_clock_s=60, devices=case["devices"]), precision=PRECISION,
                 seq_len=case["seq_len"], vocab_size=vocab, micro_batches=(case["micro_batch"],),
                 optimizer_bits=(case["optimizer_bits"],), memory_limit_bytes=cap)
    # the solver's warmup is for its own step count; a shorter run needs the warmup of STEPS
    # (the plan's rule: warmup_steps <= max_steps), the same rule plan_for_choice applies
    d = dataclasses.replace(plan.decisions, max_steps=STEPS, warmup_steps=warmup_steps_for(STEPS),
                            max_tokens=STEPS * plan.predictions.tokens_per_step)
    return dataclasses.replace(plan, decisions=d)


def run_case(case: dict, data, out: Path, smoke: bool = False) -> dict:
    """One configuration planned, run and compared; `smoke`: the held-out loss on one micro-batch
    every other step (the 4+ points calibration's law fit needs, at a fraction of the default
    evaluation's cost)."""
    from trainplan.executor.train import run
    from trainplan.executor.worker import launch

    vocab = data.vocab_size
    ck = case["activation_checkpoint"]
    if ck == "planned":
        plan = planned_plan(case, vocab)
    else:
        plan = plan_for_choice("tiny-llama", HW, **case, precision=PRECISION, vocab_size=vocab,
                               max_steps=STEPS)
    policies = plan.decisions.activation_checkpoint
    run_dir = out / "runs" / "_".join(f"{k}{v}" for k, v in case.items())
    shutil.rmtree(run_dir, ignore_errors=True)
    if case["devices"] > 1:
        run_dir.mkdir(parents=True)
        plan.to_json(run_dir / "plan.json")
        launch(run_dir / "plan.json", run_dir, None, None)
        from trainplan.executor.reporting.report import load_run

        plan, record = load_run(run_dir)
    else:
        evals = dict(eval_every=2, eval_tokens=case["seq_len"] * case["micro_batch"]) if smoke else {}
        record = run(plan, data=data, out=run_dir, progress=False, device=DEVICE, checkpoint_every=0, **evals)
        plan.to_json(run_dir / "plan.json")
    df = compare(plan, record).set_index("term")
    row = dict(case, policies="+".join(policies))
    for term in ("peak_memory", "flops_per_step", "step_time"):
        if term in df.index:
            row[f"{term}_predicted"] = df.loc[term, "predicted"]
            row[f"{term}_measured"] = df.loc[term, "measured"]
            row[f"{term}_rel_err"] = df.loc[term, "rel_err"]
    # step time: a one-thread single-process step's process CPU time is its time without the
    # other jobs of a shared machine; multi-process steps wait on each other, so wall time
    row["step_time_wall_measured"] = record.median_step_time_s
    row["step_time_cpu_measured"] = record.median_step_cpu_time_s
    on_cpu = record.device.startswith("cpu")
    if on_cpu and case["devices"] == 1 and torch.get_num_threads() == 1 and "step_time_predicted" in row:
        row["step_time_basis"] = "cpu"
        row["step_time_measured"] = record.median_step_cpu_time_s
        row["step_time_rel_err"] = row["step_time_predicted"] / row["step_time_measured"] - 1
    else:
        row["step_time_basis"] = "wall"
    row["per_rank_peak_bytes"] = json.dumps(record.per_rank_peak_bytes)
    row["run_dir"] = str(run_dir)
    return row


def calibrated_step_times(df: pd.DataFrame, out: Path) -> pd.DataFrame:
    """Calibrate the cpu profile on the even-numbered single-process cases (in a scratch copy
    of the cache, so the user's profile is untouched) and predict every case's step time
    again; the odd-numbered cases are the held-out test set."""
    import os
    import tempfile

    from trainplan.executor.calibrate.calibration import calibrate
    from trainplan.hardware_profiles.cpu import cache_path
    from trainplan.planner.capture.setup import capture_model

    scratch = Path(tempfile.mkdtemp(prefix="trainplan-acc-"))
    src = cache_path()
    os.environ["TRAINPLAN_CACHE_DIR"] = str(scratch)
    (scratch / "hardware").mkdir(parents=True)
    if src.exists():
        shutil.copy(src, cache_path())
    df = df.copy()
    df["calibration_set"] = [i % 2 == 0 and d == 1 for i, d in enumerate(df["devices"])]
    calibrate(list(df.loc[df["calibration_set"], "run_dir"]), capture_model=capture_model, verbose=False,
              time_basis="cpu" if (df.loc[df["calibration_set"], "step_time_basis"] == "cpu").all() else "wall")
    after = []
    for _, r in df.iterrows():
        if r["activation_checkpoint"] == "planned":  # solved sets are not re-predicted here
            after.append(float("nan"))
            continue
        case = {k: r[k] for k in ("seq_len", "micro_batch", "sp_degree", "devices", "zero_stage",
                                  "optimizer_bits")}
        plan = plan_for_choice("tiny-llama", "cpu", **case, activation_checkpoint=tuple(r["policies"].split("+")),
                               vocab_size=8192)
        after.append(plan.predictions.step_time_s)
    df["step_time_calibrated_predicted"] = after
    df["step_time_calibrated_rel_err"] = ((df["step_time_calibrated_predicted"] - df["step_time_measured"])
                                          / df["step_time_measured"])
    shutil.rmtree(scratch, ignore_errors=True)
    return df


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller grid, about two minutes")
    ap.add_argument("--smoke", action="store_true", help="one case, for the test suite (seconds)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--hw", default="cpu", help="profile the plans are made for (e.g. h200)")
    ap.add_argument("--device", help="where to run, e.g. cuda (default: the profile's device)")
    ap.add_argument("--precision", default="fp32", help="fp32, bf16-mixed or bf16")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for single-process runs (default 1: a multi-threaded CPU step "
                         "stalls whenever another process takes a core; the cpu profile is measured "
                         "at the same thread count)")
    a = ap.parse_args(argv)
    if a.threads < 1:
        ap.error(f"--threads must be at least 1, got {a.threads}")
    torch.set_num_threads(a.threads)
    # runs and the cpu profile use it (trainplan.hardware_profiles.threads)
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    global HW, DEVICE, PRECISION
    HW, DEVICE, PRECISION = a.hw, a.device, a.precision
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    data = load_corpus(vocab_size=8192)
    rows = []
    multi = HW == "cpu" and (DEVICE or "cpu") == "cpu"
    for i, case in enumerate(grid(a.quick, multi, a.smoke)):
        row = run_case(case, data, out, a.smoke)
        rows.append(row)
        print(f"[{i + 1}] {case} peak {row['peak_memory_rel_err']:+.4%} flops "
              f"{row['flops_per_step_rel_err']:+.4%} time {row.get('step_time_rel_err', float('nan')):+.1%}",
              flush=True)
    df = pd.DataFrame(rows)
    if HW == "cpu":  # calibration refits the cpu profile only
        df = calibrated_step_times(df, out)
    else:
        df["calibration_set"] = False
        df["step_time_calibrated_rel_err"] = float("nan")
    df.to_csv(out / "accuracy.csv", index=False)
    test = df[~df["calibration_set"]]

    def stat(col, fn):
        xs = [abs(v) for v in df[col].dropna()] if col in df else []  # no step times off the plan's hardware
        return float(fn(xs)) if xs else float("nan")

    summary = {
        "cases": len(df),
        "peak_memory_median_rel_err": stat("peak_memory_rel_err", statistics.median),
        "peak_memory_max_rel_err": stat("peak_memory_rel_err", max),
        "flops_max_rel_err": stat("flops_per_step_rel_err", max),
        "step_time_median_rel_err": float(test["step_time_calibrated_rel_err"].abs().median()),
        "step_time_max_rel_err": float(test["step_time_calibrated_rel_err"].abs().max()),
        "step_time_median_rel_err_uncalibrated": stat("step_time_rel_err", statistics.median),
        "step_time_test_cases": int(test["step_time_calibrated_rel_err"].notna().sum()),
        "quick": a.quick,
        "smoke": a.smoke,
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
                   + (f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""),
        "hw": HW,
        "precision": PRECISION,
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    (out / "accuracy.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
