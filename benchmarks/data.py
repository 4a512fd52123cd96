"""Data selection at a fixed compute budget on this machine's CPU: held-out loss against kept
fraction for each scoring method, measured beside the loss model's prediction.

    python benchmarks/data.py [--quick] [--out DIR] [--jobs 2] [--save-fits]

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
`executor.selection`) are converted to steps and taken off: steps_m = S - ceil(scoring_m /
flops_per_step) (Yin and Rush 2025). Fraction 1.0 is run for random only: keeping everything
after scoring it is the same data with fewer steps.

Training: the benchmark's own minimal loop (plan from `planner.api.plan_for_choice`, model
`planner.presets.build_model`, `executor.train.build_optimizer` and `lr_at`, loss
`planner.capture.lm_loss`, batches `TokenBatches(keep_indices=...)`), because every cell selects
from the same junk-laced candidate pool, not from a whole corpus as `executor.train.run`'s
`PlannedBatches` does. Cells run in `--jobs` processes of one
torch thread each (small GEMMs under contention run much slower with two threads a process).
Scores (and the reference model) are cached in $TRAINPLAN_CACHE_DIR, so a rerun skips scoring
but charges the same FLOPs.

Prediction (`costmodels.data_value`): E, B, beta and R_D* of the law are fitted on the random
runs' held-out curves in the constant-learning-rate phase (`fit_local_law(fit_r_d_star=True)`),
plus one offset for the final cooldown (mean final-minus-law of the random runs). Each selection
method's quality q(f) = 1 + a (1 - f) (b pinned to 1) is fitted on its pilot fractions; the other
fractions are predicted out of sample. Both errors are reported. `--save-fits` caches the fitted
multipliers for tiny-llama (`costmodels.data_value.save_quality_fits`), where the planner's method
choice (`planner.data_choice`) finds them: they describe this junk-laced pool, so save them only
to plan for data like it.

Writes DIR/data.csv (one row per cell) and DIR/data.json (summary); prints the summary last.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import math
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MODEL, SEQ_LEN, MICRO_BATCH, VOCAB = "tiny-llama", 128, 8, 8192
LR = 1e-3
"""Peak learning rate of every run (the plan's knob; plan_for_choice's default is 3e-3). At 3e-3
tiny-llama sits on the unigram plateau (about 6.6 nats) for a data-dependent number of steps,
so at this budget the final loss says more about when a run left the plateau than about its
data; at 1e-3 the held-out curves fall smoothly."""
EVAL_BATCHES = 8
TARGET_WINDOWS = 64
SEED = 0


@dataclass(frozen=True)
class Grid:
    pool: int
    """Candidate windows (the corpus every method selects from)."""
    junk: float
    """Share of the pool's windows replaced by uniformly random tokens (low-quality data)."""
    steps: int
    """S: optimizer steps the whole budget buys when nothing is spent on scoring."""
    fractions: tuple[float, ...]
    """Kept fractions of the random baseline (1.0 included)."""
    sel_fractions: tuple[float, ...]
    """Kept fractions of the selection methods."""
    pilot: tuple[float, ...]
    """Fractions whose runs fit each method's quality multiplier; the others are held out."""
    methods: tuple[str, ...]
    curve_points: int = 4
    """Held-out evaluations of the random runs in the constant-rate phase (law fit)."""


FULL = Grid(pool=1024, junk=0.25, steps=80, fractions=(0.25, 0.5, 0.75, 1.0),
            sel_fractions=(0.25, 0.5, 0.75), pilot=(0.25, 0.75),
            methods=("random", "loss", "influence", "dsir"))
QUICK = Grid(pool=512, junk=0.25, steps=30, fractions=(0.75, 1.0), sel_fractions=(0.75,),
             pilot=(0.75,), methods=("random", "loss", "influence", "dsir"), curve_points=3)


@dataclass(frozen=True)
class Data:
    tokens: torch.Tensor
    """(n,) int64 training stream with the junk windows written in."""
    vocab_size: int
    pool: np.ndarray
    """(grid.pool,) sorted candidate window indices."""
    junk: np.ndarray
    """Sorted indices of the pool windows that are junk."""
    evals: list
    target: torch.Tensor
    name: str


def build_data(grid: Grid) -> Data:
    """The default corpus with a random pool of windows, `grid.junk` of them overwritten with
    uniformly random tokens (all but the window's first token, so no clean window changes); the
    first 64 held-out windows to evaluate; the next 64 (after a one-window gap) as target set."""
    from executor.data import heldout_batches, load_corpus

    corpus = load_corpus(vocab_size=VOCAB)
    rng = np.random.default_rng(SEED)
    n_windows = (corpus.n_train_tokens - 1) // SEQ_LEN
    pool = np.sort(rng.choice(n_windows, size=grid.pool, replace=False))
    junk = np.sort(rng.choice(pool, size=round(grid.junk * grid.pool), replace=False))
    tokens = corpus.train_tokens.clone()
    for w in junk:
        tokens[w * SEQ_LEN + 1:(w + 1) * SEQ_LEN] = torch.from_numpy(
            rng.integers(0, corpus.vocab_size, SEQ_LEN - 1))
    held = corpus.heldout_tokens
    evals = heldout_batches(held, seq_len=SEQ_LEN, micro_batch=MICRO_BATCH,
                            max_batches=EVAL_BATCHES)
    start = (EVAL_BATCHES * MICRO_BATCH + 1) * SEQ_LEN  # one window's gap after the eval windows
    return Data(tokens=tokens, vocab_size=corpus.vocab_size, pool=pool, junk=junk, evals=evals,
                target=held[start:start + TARGET_WINDOWS * SEQ_LEN + 1], name=corpus.name)


def step_flops(data: Data) -> float:
    """FLOPs of one tiny-llama training step (FlopCounterMode, as executor.train counts)."""
    from torch.utils.flop_counter import FlopCounterMode

    from executor.data import TokenBatches
    from planner.capture import CPU_ATTENTION_FLOP_FORMULAS, lm_loss
    from planner.presets import build_model

    model = build_model(MODEL, device="cpu", vocab_size=data.vocab_size, seed=SEED)
    x, y = TokenBatches(data.tokens, seq_len=SEQ_LEN, micro_batch=MICRO_BATCH).batch(0)
    fc = FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOP_FORMULAS)
    with fc:
        lm_loss(model(input_ids=x).logits, y).backward()
    return float(fc.get_total_flops())


def train(plan, data: Data, keep: np.ndarray, eval_at: set[int]) -> tuple[float, list]:
    """Train a fresh tiny-llama on the kept windows for plan.decisions.max_steps; returns (final
    held-out loss, [(steps, loss)] at `eval_at` and at the end)."""
    from executor.data import TokenBatches
    from executor.train import build_optimizer, lr_at
    from planner.capture import lm_loss
    from planner.presets import build_model

    d = plan.decisions
    model = build_model(MODEL, device="cpu", vocab_size=data.vocab_size, seed=d.seed)
    model.train()
    opt = build_optimizer(model.parameters(), bits=d.optimizer_bits, lr=d.lr)
    batches = TokenBatches(data.tokens, seq_len=d.seq_len, micro_batch=d.micro_batch,
                           keep_indices=keep, seed=d.seed)

    @torch.no_grad()
    def held_loss() -> float:
        model.eval()
        out = float(np.mean([lm_loss(model(input_ids=x).logits, y).item()
                             for x, y in data.evals]))
        model.train()
        return out

    curve = []
    for step in range(d.max_steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, plan)
        x, y = batches.batch(step)
        loss = lm_loss(model(input_ids=x).logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not math.isfinite(loss.item()):
            raise RuntimeError(f"loss became {loss.item()} at step {step}")
        if step + 1 in eval_at and step + 1 < d.max_steps:
            curve.append((step + 1, held_loss()))
    final = held_loss()
    curve.append((d.max_steps, final))
    return final, curve


def stable_points(steps: int, n: int) -> list[int]:
    """n evaluation steps in the constant-rate phase of `lr_at` (after warmup, before the
    cooldown over the last 20% of steps)."""
    cool_start = steps - max(1, int(0.2 * steps))
    warm = max(1, min(20, steps // 10))
    lo = max(warm + 1, cool_start // n)
    return sorted({int(round(v)) for v in np.linspace(lo, cool_start, n)})


_WORKER: dict = {}


def _init_worker(grid: Grid) -> None:
    torch.set_num_threads(1)
    _WORKER["data"] = build_data(grid)


def _run_cell(cell: dict) -> dict:
    """Train one (method, fraction) cell; returns its CSV row (in a worker process or not)."""
    from planner.api import plan_for_choice

    data: Data = _WORKER["data"]
    keep = np.asarray(cell["keep"])
    plan = plan_for_choice(MODEL, "cpu", seq_len=SEQ_LEN, micro_batch=MICRO_BATCH,
                           max_steps=cell["steps"], data_fraction=cell["fraction"],
                           vocab_size=data.vocab_size, data_tokens=len(data.pool) * SEQ_LEN,
                           lr=LR)
    t = time.perf_counter()
    final, curve = train(plan, data, keep, set(cell["eval_at"]))
    fps = cell["flops_per_step"]
    return dict(method=cell["method"], fraction=cell["fraction"], kept_windows=len(keep),
                junk_share=float(np.isin(keep, data.junk).mean()),
                unique_tokens=len(keep) * SEQ_LEN, steps=cell["steps"],
                tokens_seen=cell["steps"] * MICRO_BATCH * SEQ_LEN,
                scoring_steps=cell["scoring_steps"], scoring_flops=cell["scoring_flops"],
                train_flops=cell["steps"] * fps,
                total_flops=cell["steps"] * fps + cell["scoring_flops"], measured_loss=final,
                curve=curve, wall_s=time.perf_counter() - t)


def score_all(grid: Grid, data: Data, fps: float, log) -> dict:
    """Score the pool once per method (cached on disk); {method: (WindowScores, steps charged)}."""
    from executor.selection import score_windows

    scored = {}
    for method in grid.methods:
        t = time.perf_counter()
        s = score_windows(data.tokens, seq_len=SEQ_LEN, method=method, windows=data.pool,
                          target_tokens=data.target, seed=SEED, vocab_size=data.vocab_size)
        scored[method] = (s, math.ceil(s.flops / fps))
        log(f"scored {method}: {s.flops / 1e9:.1f} GFLOP = {scored[method][1]} steps"
            f"{' (cached)' if s.cached else ''} in {time.perf_counter() - t:.1f} s")
    return scored


def train_all(grid: Grid, data: Data, scored: dict, fps: float, jobs: int, log) -> list[dict]:
    from executor.selection import select

    cells = []
    for method, f in [("random", f) for f in grid.fractions] + [
            (m, f) for m in grid.methods if m != "random" for f in grid.sel_fractions]:
        s, charge = scored[method]
        steps = grid.steps - charge
        if steps < 1:
            log(f"skip {method} f={f}: scoring costs {charge} steps >= S={grid.steps}")
            continue
        cells.append(dict(method=method, fraction=f, steps=steps, scoring_steps=charge,
                          scoring_flops=s.flops, flops_per_step=fps,
                          keep=select(s.scores, f, seed=SEED, windows=s.windows).tolist(),
                          eval_at=stable_points(steps, grid.curve_points)
                          if method == "random" else []))
    cells.sort(key=lambda c: -(c["steps"] + 10 * len(c["eval_at"])))  # longest first
    rows = []

    def done(row):
        rows.append(row)
        log(f"{row['method']:9s} f={row['fraction']:<5g} steps={row['steps']:3d} held-out loss "
            f"{row['measured_loss']:.4f} (junk kept {row['junk_share']:.2f}, "
            f"{row['wall_s']:.0f} s)")

    if jobs > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(jobs, _init_worker, (grid,)) as pool:
            for row in pool.imap_unordered(_run_cell, cells):
                done(row)
    else:
        _WORKER["data"] = data
        for cell in cells:
            done(_run_cell(cell))
    order = {(c["method"], c["fraction"]): i for i, c in enumerate(
        sorted(cells, key=lambda c: (grid.methods.index(c["method"]), c["fraction"])))}
    return sorted(rows, key=lambda r: order[(r["method"], r["fraction"])])


def predict(grid: Grid, rows: list[dict], n_params: int) -> tuple[dict, dict]:
    """Fill each row's predicted loss; returns (law summary, quality fits)."""
    from costmodels.data_value import (DEFAULT_QUALITY, fit_local_law, fit_quality,
                                       subset_loss)

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
    from planner.api import plan_for_choice

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
            from costmodels.data_value import save_quality_fits

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
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--steps", type=int, help="override S (budget in steps)")
    ap.add_argument("--pool", type=int, help="override the candidate pool size (windows)")
    ap.add_argument("--methods", help="comma-separated methods (random is always run)")
    ap.add_argument("--junk", type=float, help="override the junk share of the pool")
    ap.add_argument("--jobs", type=int, default=2, help="cells trained in parallel (processes)")
    ap.add_argument("--save-fits", action="store_true",
                    help="cache the fitted quality multipliers for the planner")
    args = ap.parse_args(argv)
    grid = QUICK if args.quick else FULL
    if args.steps or args.pool or args.methods or args.junk is not None:
        methods = tuple(dict.fromkeys(["random"] + (args.methods.split(",") if args.methods
                                                     else list(grid.methods))))
        grid = Grid(**{**grid.__dict__, "steps": args.steps or grid.steps,
                       "pool": args.pool or grid.pool, "methods": methods,
                       "junk": grid.junk if args.junk is None else args.junk})
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, summary = run_grid(grid, max(1, args.jobs),
                             lambda msg: print(msg, file=sys.stderr, flush=True), args.save_fits)
    cols = ["method", "fraction", "kept_windows", "junk_share", "unique_tokens", "steps",
            "tokens_seen", "scoring_steps", "scoring_flops", "train_flops", "total_flops", "quality",
            "measured_loss", "predicted_loss", "rel_err", "role", "wall_s", "curve"]
    with open(out / "data.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows({**r, "curve": ";".join(f"{st}:{loss:.5f}" for st, loss in r["curve"])}
                    for r in rows)
    summary.update(quick=args.quick, machine=platform.machine() + " " + platform.node(),
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
