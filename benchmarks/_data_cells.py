"""The data-selection benchmark's setup and cells, split out of `benchmarks/data.py` (see its
docstring for the setup, the equal-compute rule and the prediction).

Holds the grid (`Grid`, `FULL`, `QUICK`) and its constants, the junk-laced candidate pool
(`Data`, `build_data`), the FLOPs of one step (`step_flops`), the benchmark's own training loop
(`train`, `stable_points`), scoring the pool once per method (`score_all`) and training every
(method, fraction) cell, in worker processes or not (`train_all`, `_run_cell`).
`benchmarks/data.py` imports it as a sibling module (running the script puts its folder on
`sys.path`, and spawned workers inherit that path) and re-exports these names.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

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
SMOKE = Grid(pool=128, junk=0.25, steps=8, fractions=(0.75, 1.0), sel_fractions=(0.75,),
             pilot=(0.75,), methods=("random", "dsir"), curve_points=3)
"""--smoke (the test suite's run): random and DSIR at one fraction on a small pool, a few steps."""


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
    from trainplan.executor.data.batches import heldout_batches, load_corpus

    corpus = load_corpus(vocab_size=VOCAB)
    rng = np.random.default_rng(SEED)
    n_windows = (corpus.n_train_tokens - 1) // SEQ_LEN
    pool = np.sort(rng.choice(n_windows, size=grid.pool, replace=False))
    junk = np.sort(rng.choice(pool, size=round(grid.junk * grid.pool), replace=False))
    tokens = torch.from_numpy(np.array(corpus.train_tokens, dtype=np.int64))  # a copy: the corpus is a memmap
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
    """FLOPs of one tiny-llama training step (FlopCounterMode, as trainplan.executor.train counts)."""
    from torch.utils.flop_counter import FlopCounterMode

    from trainplan.executor.data.batches import TokenBatches
    from trainplan.modeling.flop_counting import CPU_ATTENTION_FLOP_FORMULAS
    from trainplan.modeling.loss import lm_loss
    from trainplan.modeling.presets import build_model

    model = build_model(MODEL, device="cpu", vocab_size=data.vocab_size, seed=SEED)
    x, y = TokenBatches(data.tokens, seq_len=SEQ_LEN, micro_batch=MICRO_BATCH).batch(0)
    fc = FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOP_FORMULAS)
    with fc:
        lm_loss(model(input_ids=x).logits, y).backward()
    return float(fc.get_total_flops())


def train(plan, data: Data, keep: np.ndarray, eval_at: set[int]) -> tuple[float, list]:
    """Train a fresh tiny-llama on the kept windows for plan.decisions.max_steps; returns (final
    held-out loss, [(steps, loss)] at `eval_at` and at the end)."""
    from trainplan.executor.apply.applied import lr_at
    from trainplan.executor.data.batches import TokenBatches
    from trainplan.executor.optimizers import build_optimizer
    from trainplan.modeling.loss import lm_loss
    from trainplan.modeling.presets import build_model

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
    os.environ["OMP_NUM_THREADS"] = "1"  # the cpu profile is measured at it (trainplan.hardware_profiles.threads)
    _WORKER["data"] = build_data(grid)


def _run_cell(cell: dict) -> dict:
    """Train one (method, fraction) cell; returns its CSV row (in a worker process or not)."""
    from trainplan.planner.api import plan_for_choice

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
    from trainplan.executor.data.selection import score_windows

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
    from trainplan.executor.data.selection import select

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
