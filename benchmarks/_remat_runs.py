"""The measurements of benchmarks/remat.py: a plan's real run (`trainplan.executor.train.run`: MemTracker's
peak and the FLOPs) and the interleaved step timing of plans at one sequence, each applied by
`trainplan.executor.apply.apply_plan` (checkpoint sets, tiled loss, tiled MLP) as the executor runs it.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch
from _remat_plans import MODEL, STEPS

ROUNDS = 4
"""Timed steps per plan (after a warm-up round) in the interleaved overhead timing."""
TIMING_THREADS = 1
"""torch threads while timing: a multi-threaded step stalls whenever another process takes a
core (OpenMP workers wait for each other), one thread degrades gracefully; the ratio of two
plans' step times is what is measured."""
LOAD_SAMPLES: list[float] = []
"""1-minute load averages sampled at each interleaved timing (`os.getloadavg`): what else ran."""

_RUNS: dict[tuple, tuple] = {}


def run_key(plan) -> tuple:
    """What makes two plans the same run: sequence, micro-batch, each block's saved set and the
    tiling."""
    d = plan.decisions
    return (d.seq_len, d.micro_batch, tuple(frozenset(d.checkpoint_sets.get(e, [e])) for e in d.activation_checkpoint),
            d.loss_chunks, d.mlp_chunks)


def real_run(plan, data, out: Path) -> tuple[float, float]:
    """(measured peak bytes, FLOPs per step) of one real run (`trainplan.executor.train.run`, STEPS steps:
    MemTracker's peak, FlopCounterMode's FLOPs), once per distinct plan (`run_key`: strategies
    often land on the same plan)."""
    import trainplan.executor.train as train

    key = run_key(plan)
    if key not in _RUNS:
        shutil.rmtree(out, ignore_errors=True)
        # one held-out micro-batch at the end: this benchmark reads no loss, and the default
        # 16,384 tokens at a long sequence cost more than the run's steps
        rec = train.run(plan, data=data, out=out, progress=False, eval_every=STEPS, checkpoint_every=0,
                        eval_tokens=plan.decisions.seq_len * plan.decisions.micro_batch)
        _RUNS[key] = rec.peak_memory_bytes.get("total", float("nan")), rec.flops_per_step
    return _RUNS[key]


def interleaved_times(plans: list, data, rounds: int = ROUNDS) -> list[float]:
    """Step seconds of each of `plans` (same sequence and micro-batch, one device), each applied
    to its own model by `trainplan.executor.apply.apply_plan` (checkpoint sets, tiled MLP, deferred head
    and tiled loss, optimizer) and stepped as `trainplan.executor.train.run` steps it (`AppliedPlan.loss`,
    backward, optimizer step), one step of each in turn so that other load on the machine hits
    them alike, on TIMING_THREADS torch threads: each plan's fastest step after one warm-up
    round."""
    from trainplan.executor.apply.applied import apply_plan
    from trainplan.executor.data.batches import TokenBatches
    from trainplan.modeling.presets import build_model

    d = plans[0].decisions
    batches = TokenBatches(data.train_tokens, seq_len=d.seq_len, micro_batch=d.micro_batch,
                           fraction=1.0, seed=0, rank=0, world_size=1)
    steppers = []
    for p in plans:
        model = build_model(MODEL, device="cpu", vocab_size=data.vocab_size, seed=0)
        applied = apply_plan(p, model, device="cpu", lr_scheduler=False)

        def step(i, a=applied):
            x, y = batches.batch(i)
            t0 = time.perf_counter()
            a.loss(x, y).backward()
            a.optimizer.step()
            a.optimizer.zero_grad(set_to_none=True)
            return time.perf_counter() - t0

        steppers.append(step)
    times = [[] for _ in plans]
    threads = torch.get_num_threads()
    torch.set_num_threads(TIMING_THREADS)
    LOAD_SAMPLES.append(os.getloadavg()[0])
    try:
        for i in range(rounds + 1):
            for t, step in zip(times, steppers, strict=True):
                dt_ = step(i)
                if i:  # round 0 warms up
                    t.append(dt_)
    finally:
        torch.set_num_threads(threads)
    return [min(t) for t in times]
