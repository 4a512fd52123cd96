"""Data selection at a fixed compute budget on this machine's CPU: held-out loss against kept
fraction for each scoring method, measured beside the loss model's prediction.

    python benchmarks/data.py [--quick | --smoke] [--out DIR] [--jobs 2] [--save-fits]

Setup: tiny-llama (7.1M parameters), seq_len 128, micro-batch 8, the default corpus (Shakespeare,
BPE 8192). The candidate corpus is a fixed random pool of training windows (1,024; quick: 512),
a quarter of which are overwritten with uniformly random tokens: a stand-in for the low-quality
share of a crawled corpus, which is what pruning studies remove (Marion et al. 2023; Ankner et
al. 2024); `--junk 0` benchmarks the clean corpus. Every method keeps a fraction f of the pool,
f on the solver's default grid {0.25, 0.5, 0.75, 1.0} (so f = 0.75 can drop exactly the junk).
Evaluation: the first 64 held-out windows (`heldout_batches`, 8 batches). Target set of
influence/DSIR: the next 64 held-out windows (after a one-window gap: no shared token).

Equal compute: every cell gets S * flops_per_step FLOPs (one tiny-llama step counted with
FlopCounterMode). A method's scoring FLOPs (reference training + scoring pass, counted by
`trainplan.executor.data.selection`) are converted to steps and taken off: steps_m = S - ceil(scoring_m /
flops_per_step) (Yin and Rush 2025). Fraction 1.0 is run for random only: keeping everything
after scoring it is the same data with fewer steps.

Training: the benchmark's own minimal loop (plan from `trainplan.planner.api.plan_for_choice`, model
`trainplan.modeling.presets.build_model`, `trainplan.executor.optimizers.build_optimizer` and `lr_at`, loss
`trainplan.planner.capture.graph.lm_loss`, batches `TokenBatches(keep_indices=...)`), because every cell selects
from the same junk-laced candidate pool, not from a whole corpus as `trainplan.executor.train.run`'s
`PlannedBatches` does. Cells run in `--jobs` processes of one
torch thread each (small GEMMs under contention run much slower with two threads a process).
Scores (and the reference model) are cached in $TRAINPLAN_CACHE_DIR, so a rerun skips scoring
but charges the same FLOPs.

Prediction (`trainplan.costmodels.data.value`): E, B, beta and R_D* of the law are fitted on the random
runs' held-out curves in the constant-learning-rate phase (`fit_local_law(fit_r_d_star=True)`),
plus one offset for the final cooldown (mean final-minus-law of the random runs). Each selection
method's quality q(f) = 1 + a (1 - f) (b pinned to 1) is fitted on its pilot fractions; the other
fractions are predicted out of sample. Both errors are reported. `--save-fits` caches the fitted
multipliers for tiny-llama (`trainplan.costmodels.data.quality_cache.save_quality_fits`), where the planner's method
choice (`trainplan.planner.data_choice`) finds them: they describe this junk-laced pool, so save them only
to plan for data like it.

Writes DIR/data.csv (one row per cell) and DIR/data.json (summary); prints the summary last.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from _data_cells import _WORKER as _WORKER
from _data_cells import EVAL_BATCHES as EVAL_BATCHES

# The grid, the candidate pool, the training loop and the cells live beside this script in
# _data_cells.py (importable because the script's folder is on sys.path); re-exported here.
from _data_cells import (
    FULL,
    LR,
    MICRO_BATCH,
    MODEL,
    QUICK,
    SEQ_LEN,
    SMOKE,
    Grid,
    build_data,
    score_all,
    step_flops,
    train_all,
)
from _data_cells import SEED as SEED
from _data_cells import TARGET_WINDOWS as TARGET_WINDOWS
from _data_cells import VOCAB as VOCAB
from _data_cells import Data as Data
from _data_cells import _init_worker as _init_worker
from _data_cells import _run_cell as _run_cell
from _data_cells import stable_points as stable_points
from _data_cells import train as train


def predict(grid: Grid, rows: list[dict], n_params: int) -> tuple[dict, dict]:
    """Fill each row's predicted loss; returns (law summary, quality fits)."""
    from trainplan.costmodels.data.fit import fit_local_law, fit_quality
    from trainplan.costmodels.data.quality import DEFAULT_QUALITY
    from trainplan.costmodels.data.value import subset_loss

    pool_tokens = grid.pool * SEQ_LEN
    rand = [r for r in rows if r["method"] == "random"]
    pts = [(r["unique_tokens"], st * MICRO_BATCH * SEQ_LEN, loss) for r in rand
           for st, loss in r["curve"][:-1]]
    law = fit_local_law(n_params, [p[1] for p in pts], [p[0] for p in pts],
                        [p[2] for p in pts], fit_r_d_star=any(p[1] > p[0] for p in pts))

    def base(r: dict, fit=DEFAULT_QUALITY["random"]) -> float:
        return subset_loss(law, n_params, r["tokens_seen"], pool_tokens, r["fraction"], fit)

    offset = float(np.mean([r["measured_loss"] - base(r) for r in rand]))
    for r in rand:
        r["predicted_loss"], r["role"], r["quality"] = base(r) + offset, "law fit", 1.0
    fits = {}
    for method in grid.methods[1:]:
        mine = [r for r in rows if r["method"] == method]
        pilot = [r for r in mine if r["fraction"] in grid.pilot]
        if not pilot:
            continue
        fit = fit_quality([r["fraction"] for r in pilot], [r["measured_loss"] for r in pilot],
                          law, n_params=n_params, tokens_seen=[r["tokens_seen"] for r in pilot],
                          corpus_tokens=pool_tokens, method=method, offset=offset, fix_b=1.0)
        fits[method] = fit
        for r in mine:
            r["predicted_loss"], r["quality"] = base(r, fit) + offset, fit.q(r["fraction"])
            r["role"] = "pilot (in-sample)" if r in pilot else "held out"
    for r in rows:
        r["rel_err"] = abs(r["predicted_loss"] - r["measured_loss"]) / r["measured_loss"]
    return {"law_E": law.E, "law_B": law.B, "law_beta": law.beta, "law_r_d_star": law.r_d_star,
            "cooldown_offset": offset}, fits


def run_grid(grid: Grid, jobs: int, log, save_fits: bool = False) -> tuple[list[dict], dict]:
    from trainplan.planner.api import plan_for_choice

    t0 = time.perf_counter()
    data = build_data(grid)
    fps = step_flops(data)
    n_params = plan_for_choice(MODEL, "cpu", seq_len=SEQ_LEN, micro_batch=MICRO_BATCH,
                               vocab_size=data.vocab_size).model_n_params
    log(f"{data.name}: pool {grid.pool} windows ({grid.pool * SEQ_LEN:,} tokens, "
        f"{len(data.junk)} junk), S={grid.steps} steps of {fps / 1e9:.2f} GFLOP, {jobs} job(s)")
    scored = score_all(grid, data, fps, log)
    rows = train_all(grid, data, scored, fps, jobs, log)
    law, fits = predict(grid, rows, n_params)
    if save_fits:
        # a multiplier at its bound says the law's floor is off, not how good the subset is
        good = {m: f for m, f in fits.items() if f.a < 0.99e3}
        if len(good) < len(fits):
            log(f"not saving the fits of {', '.join(sorted(set(fits) - set(good)))}: a at its bound")
        if good:
            from trainplan.costmodels.data.quality_cache import save_quality_fits

            path = save_quality_fits(good, model=MODEL, vocab_size=data.vocab_size,
                                     corpus=f"{data.name} pool of {grid.pool} windows, "
                                            f"{grid.junk:.0%} junk (benchmarks/data.py)")
            log(f"quality fits of {', '.join(good)} saved to {path}")

    rand = [r for r in rows if r["method"] == "random"]
    best_rand = min(rand, key=lambda r: r["measured_loss"])
    sel = [r for r in rows if r["method"] != "random"] or rand
    best_sel = min(sel, key=lambda r: r["measured_loss"])
    best = min(rows, key=lambda r: r["measured_loss"])
    held_out = [r["rel_err"] for r in rows if r["role"] == "held out"]
    max_err = max(r["rel_err"] for r in rows)
    summary = {
        "best_method": best["method"],
        "best_fraction": best["fraction"],
        "best_loss": best["measured_loss"],
        "best_selection_method": best_sel["method"],
        "best_selection_fraction": best_sel["fraction"],
        "best_random_fraction": best_rand["fraction"],
        "best_random_loss": best_rand["measured_loss"],
        "best_vs_random_loss_delta": best_sel["measured_loss"] - best_rand["measured_loss"],
        "selection_beats_random": best_sel["measured_loss"] < best_rand["measured_loss"],
        "loss_prediction_max_rel_err": max_err,
        "loss_prediction_max_rel_err_out_of_sample": max(held_out) if held_out else None,
        "prediction_within_5pct": max_err <= 0.05,
        "budget_steps": grid.steps,
        "lr": LR,
        "flops_per_step": fps,
        "pool_windows": grid.pool,
        "junk_share": grid.junk,
        **law,
        **{f"scoring_steps_{m}": scored[m][1] for m in grid.methods},
        **{f"quality_a_{m}": fits[m].a for m in fits},
        "train_loop": "benchmark's own loop over the shared candidate pool",
        "jobs": jobs,
        "wall_s": time.perf_counter() - t0,
    }
    return rows, summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller grid, about two minutes")
    ap.add_argument("--smoke", action="store_true", help="random and DSIR, one fraction, small pool, one job")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--steps", type=int, help="override S (budget in steps)")
    ap.add_argument("--pool", type=int, help="override the candidate pool size (windows)")
    ap.add_argument("--methods", help="comma-separated methods (random is always run)")
    ap.add_argument("--junk", type=float, help="override the junk share of the pool")
    ap.add_argument("--jobs", type=int, default=2, help="cells trained in parallel (processes)")
    ap.add_argument("--save-fits", action="store_true",
                    help="cache the fitted quality multipliers for the planner")
    args = ap.parse_args(argv)
    grid = SMOKE if args.smoke else QUICK if args.quick else FULL
    if args.steps or args.pool or args.methods or args.junk is not None:
        methods = tuple(dict.fromkeys(["random"] + (args.methods.split(",") if args.methods
                                                     else list(grid.methods))))
        grid = Grid(**{**grid.__dict__, "steps": args.steps or grid.steps,
                       "pool": args.pool or grid.pool, "methods": methods,
                       "junk": grid.junk if args.junk is None else args.junk})
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # the cpu profile is measured at it (trainplan.hardware_profiles.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, summary = run_grid(grid, 1 if args.smoke else max(1, args.jobs),
                             lambda msg: print(msg, file=sys.stderr, flush=True), args.save_fits)
    cols = ["method", "fraction", "kept_windows", "junk_share", "unique_tokens", "steps",
            "tokens_seen", "scoring_steps", "scoring_flops", "train_flops", "total_flops", "quality",
            "measured_loss", "predicted_loss", "rel_err", "role", "wall_s", "curve"]
    with open(out / "data.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows({**r, "curve": ";".join(f"{st}:{loss:.5f}" for st, loss in r["curve"])}
                    for r in rows)
    summary.update(quick=args.quick, smoke=args.smoke, machine=platform.machine() + " " + platform.node(),
                   torch=torch.__version__, date=dt.datetime.now().isoformat(timespec="seconds"))
    (out / "data.json").write_text(json.dumps(summary, indent=2) + "\n")
    for r in rows:
        print(f"{r['method']:9s} f={r['fraction']:<5g} steps={r['steps']:3d} "
              f"measured={r['measured_loss']:.4f} predicted={r['predicted_loss']:.4f} "
              f"rel_err={r['rel_err']:.3f} ({r['role']})")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
