"""Longest sequence each activation-checkpointing strategy trains under a fixed memory cap, on
this machine's CPU with the real executor, and its step-time overhead against no checkpointing.

    python benchmarks/remat.py [--quick] [--out DIR]

Model: `tiny-llama` (4 layers, hidden 256, GQA 8/4 heads, fp32, AdamW) with a 2048-token BPE of
the default corpus. The vocabulary matters: the LM head and the loss sit outside every block's
checkpoint, so their logits bound how far block checkpointing can stretch a sequence. With the
preset's 8192 tokens the logits of 4 layers of width 256 outweigh the blocks' activations and
no strategy can reach 2 x no checkpointing's sequence; with 2048 tokens the blocks dominate, as
they do in the large models the planner targets (80 layers against one LM head).

Strategies, each at its best setting for the cap:
- `no_ac`, `full_ac`, `autosp` (AutoSP's rule: keep attention outputs): one entry for every block;
- `torch_knapsack`: PyTorch's `activation_memory_budget` knapsack (dp) on each block, the
  budget tuned over 0, 0.05, ..., 1 to the least predicted step time that fits;
- `trainplan`: `planner.solve` with the memory cap (the joint CP-SAT model over the blocks'
  Pareto menus, the named entries included);
- `trainplan_15pct`: the same solver's plan at the longest sequence where its *measured*
  overhead is within 15% (down the ladder from trainplan's longest, each rung timed). At the
  very longest sequence only (nearly) full checkpointing fits, whose overhead is full
  recompute's; this is the sequence the planner reaches while keeping the overhead target.

For each (cap, micro-batch) case and strategy: the longest sequence of a x1.1 ladder from 128
whose *predicted* peak fits the cap (bisection), then a real run (`executor.train.run`, 4 steps:
2 warm-up, MemTracker, FlopCounterMode) at that sequence. It counts only when the *measured*
peak fits; when a run overshoots its prediction, the search is repeated under the cap less the
overshoot (at most 3 runs). The overhead is against no checkpointing at the same sequence
(memory cap ignored): the plans at one sequence are built and stepped by the executor's own
pieces one step of each in turn, so that other load on the machine hits them alike, on one torch
thread, and each plan's fastest of 4 steps after a warm-up counts (--quick times only the
trainplan rows).

Summary: `max_seq_ratio_vs_no_ac` (trainplan's longest sequence over no checkpointing's, the
worst case) and `overhead_at_max_seq` (measured, the worst case); the same for
`trainplan_15pct` (`..._within_15pct`); `losses_to_baselines` (cases where a baseline trained a
longer sequence than trainplan under the same cap); `targets_met` (within-15% ratio >= 2.7 at
measured overhead <= 15%, and no losses). Writes DIR/remat.csv (one row per case and strategy)
and DIR/remat.json, prints the summary last.
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

import pandas as pd
import torch

MODEL, VOCAB, STEPS = "tiny-llama", 2048, 4
MIB = 2**20
LADDER = tuple(sorted({int(round(128 * 1.1**k / 8)) * 8 for k in range(37)}))
"""Sequence lengths tried: 128 to about 4096, x1.1 apart (multiples of 8)."""
CASES = {True: [(96, 1)], False: [(96, 1), (112, 1), (160, 2)]}
"""(memory cap MiB, micro-batch) per grid; --quick is the first."""
OURS, OURS_FAST = "trainplan", "trainplan_15pct"
STRATEGIES = {True: ("no_ac", "autosp", OURS),
              False: ("no_ac", "full_ac", "autosp", "torch_knapsack", OURS)}
NAMED = {"no_ac": "none", "full_ac": "full", "autosp": "save_attention"}
MAX_RUNS = 3
"""Real runs per case and strategy: a measured peak over the cap sends the search below it."""
ROUNDS = 4
"""Timed steps per plan (after a warm-up round) in the interleaved overhead timing."""
TIMING_THREADS = 1
"""torch threads while timing: a multi-threaded step stalls whenever another process takes a
core (OpenMP workers wait for each other), one thread degrades gracefully; the ratio of two
plans' step times is what is measured."""
OVERHEAD_TARGET = 0.15


class Planner:
    """Predicted peak and step time of each strategy's plan at one (sequence, micro-batch)."""

    def __init__(self):
        from hardware_profiles import load
        from planner.capture.setup import setup_model

        self.hw = load("cpu")  # once: every prediction of the run uses the same profile
        _, self.precision, graph, _, self.sm = setup_model(MODEL, self.hw, precision=None, vocab_size=VOCAB)
        self.L = graph.n_layers

    def _choice(self, seq, mb, policies, sets=()):
        from costmodels.step.model import Choice

        return Choice(sp_degree=1, zero_stage=0, micro_batch=mb, seq_len=seq, policies=policies,
                      precision=self.precision, optimizer_bits=32, devices=1, sets=tuple(sets))

    def plan(self, strategy: str, seq: int, mb: int, cap: float) -> dict | None:
        """{policies, sets, peak, step_s} of the strategy's best fitting plan, or None."""
        if strategy in NAMED:
            c = self._choice(seq, mb, (NAMED[strategy],) * self.L)
            return self._fits(c, cap)
        if strategy == "torch_knapsack":
            from planner.joint.remat_menu import block_case
            from planner.joint.remat_strategies import BUDGETS, knapsack_set

            case = block_case(self.sm, self._choice(seq, mb, ("none",) * self.L))
            options = [self._fits(self._choice(seq, mb, ("none",) * self.L), cap)]
            for entry in {knapsack_set(case, b, "dp") for b in BUDGETS}:
                options.append(self._fits(self._choice(seq, mb, (entry.name,) * self.L, [entry]), cap))
            options = [o for o in options if o]
            return min(options, key=lambda o: o["step_s"]) if options else None
        return self._solve(seq, mb, cap)

    def _fits(self, c, cap):
        cost = self.sm.evaluate(c)
        if cost.memory.total > cap:
            return None
        return dict(policies=c.policies, sets={x.name: sorted(x.saved) for x in c.sets},
                    peak=cost.memory.total, step_s=cost.time_s)

    def _solve(self, seq, mb, cap):
        from planner.api import solve
        from planner.budget import Budget
        from trainplan_errors import InfeasibleError

        try:
            p = solve(MODEL, self.hw, Budget(wall_clock_s=10**7), seq_len=seq, vocab_size=VOCAB,
                      micro_batches=(mb,), optimizer_bits=(32,), data_fractions=(1.0,),
                      memory_limit_bytes=cap, explain=False)  # a search probe: no explanation
        except InfeasibleError:
            return None
        d = p.decisions
        return dict(policies=d.checkpoint, sets=d.checkpoint_sets, peak=p.predictions.memory_bytes["total"],
                    step_s=p.predictions.step_time_s, solve_s=p.solver.wall_s)

    def longest(self, strategy: str, mb: int, cap: float) -> int:
        """Index in LADDER of the longest sequence whose predicted peak fits (-1: none)."""
        lo, hi = -1, len(LADDER)  # fits at lo, not at hi (peaks grow with the sequence)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.plan(strategy, LADDER[mid], mb, cap):
                lo = mid
            else:
                hi = mid
        return lo


_RUNS: dict[tuple, tuple] = {}


def _run(plan, data, out: Path):
    """(measured peak bytes, FLOPs per step) of one real run, once per distinct
    plan (strategies often land on the same sets)."""
    import executor.train as train

    d = plan.decisions
    key = (d.seq_len, d.micro_batch, tuple(frozenset(d.checkpoint_sets.get(e, [e])) for e in d.checkpoint))
    if key in _RUNS:
        return _RUNS[key]

    shutil.rmtree(out, ignore_errors=True)
    rec = train.run(plan, data=data, out=out, progress=False, eval_every=STEPS, checkpoint_every=0)
    _RUNS[key] = rec.peak_memory_bytes.get("total", float("nan")), rec.flops_per_step
    return _RUNS[key]


def _interleaved_times(plans: list, data, rounds: int = ROUNDS) -> list[float]:
    """Step seconds of each of `plans` (same sequence and batch), all built and stepped by the
    executor's own pieces (`apply_checkpointing`, `build_optimizer`, `lm_loss`), one step of
    each in turn so that other load on the machine hits them alike: each plan's fastest step
    after one warm-up round."""
    from executor.apply.checkpointing import apply_checkpointing
    from executor.data.batches import TokenBatches
    from executor.optimizers import build_optimizer
    from modeling.loss import lm_loss
    from modeling.presets import build_model

    d = plans[0].decisions
    batches = TokenBatches(data.train_tokens, seq_len=d.seq_len, micro_batch=d.micro_batch,
                           fraction=1.0, seed=0, rank=0, world_size=1)
    steppers = []
    for p in plans:
        model = build_model(MODEL, device="cpu", vocab_size=data.vocab_size, seed=0)
        apply_checkpointing(model, p.decisions.checkpoint, p.decisions.checkpoint_sets)
        model.train()
        opt = build_optimizer(model.parameters(), 32, lr=1e-3)

        def step(i, model=model, opt=opt):
            x, y = batches.batch(i)
            t0 = time.perf_counter()
            lm_loss(model(input_ids=x).logits, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return time.perf_counter() - t0

        steppers.append(step)
    times = [[] for _ in plans]
    threads = torch.get_num_threads()
    torch.set_num_threads(TIMING_THREADS)
    try:
        for i in range(rounds + 1):
            for t, step in zip(times, steppers, strict=False):
                dt_ = step(i)
                if i:  # round 0 warms up
                    t.append(dt_)
    finally:
        torch.set_num_threads(threads)
    return [min(t) for t in times]


def _plan_for(planner: Planner, choice: dict, seq: int, mb: int):
    from planner.api import plan_for_choice

    return plan_for_choice(MODEL, planner.hw, seq_len=seq, micro_batch=mb, checkpoint=tuple(choice["policies"]),
                           checkpoint_sets=choice["sets"], vocab_size=VOCAB, max_steps=STEPS)


def run_case(planner: Planner, cap_mib: int, mb: int, strategies, data, out: Path, timed) -> list[dict]:
    cap = cap_mib * MIB
    rows = []
    for name in strategies:
        t0 = time.perf_counter()
        idx = planner.longest(name, mb, cap)
        search_s = time.perf_counter() - t0
        row = dict(cap_mib=cap_mib, micro_batch=mb, strategy=name, predicted_max_seq=LADDER[idx] if idx >= 0 else 0,
                   search_s=search_s, max_seq=0, attempts="")
        margin = 0.0
        for _ in range(MAX_RUNS):
            if idx < 0:
                break
            seq = LADDER[idx]
            choice = planner.plan(name, seq, mb, cap - margin)
            plan = _plan_for(planner, choice, seq, mb)
            peak, flops = _run(plan, data, out / "runs" / f"cap{cap_mib}_mb{mb}_{name}_s{seq}")
            row.update(seq=seq, predicted_peak_mib=choice["peak"] / MIB, measured_peak_mib=peak / MIB,
                       predicted_step_s=choice["step_s"], measured_flops=flops,
                       predicted_flops=plan.predictions.flops_per_step,
                       checkpoint="+".join(sorted(set(choice["policies"]))))
            row["attempts"] += f"{seq}:{peak / MIB:.2f}MiB "
            if peak <= cap:
                row["max_seq"], row["margin"] = seq, margin
                break
            # the run overshot its prediction: search again under the cap less the overshoot
            margin += peak - choice["peak"]
            idx = min(idx - 1, planner.longest(name, mb, cap - margin))
        rows.append(row)
        print(f"  cap {cap_mib} MiB mb {mb} {name:15s} predicted {row['predicted_max_seq']:5d} "
              f"trained {row['max_seq']:5d} (measured {row.get('measured_peak_mib', 0):.1f} MiB)", flush=True)
    by_seq: dict[int, list[dict]] = {}  # overhead against no checkpointing at the same sequence
    for row in rows:
        if row["max_seq"]:
            base = planner.plan("no_ac", row["max_seq"], mb, float("inf"))
            row["predicted_overhead"] = row["predicted_step_s"] / base["step_s"] - 1
            if row["strategy"] == "no_ac":
                row["overhead"] = 0.0
            elif row["strategy"] in timed:
                by_seq.setdefault(row["max_seq"], []).append(row)
    for seq, group in by_seq.items():
        plans = [_plan_for(planner, planner.plan("no_ac", seq, mb, float("inf")), seq, mb)]
        plans += [_plan_for(planner, planner.plan(r["strategy"], seq, mb, cap - r["margin"]), seq, mb)
                  for r in group]
        base_s, *mine = _interleaved_times(plans, data)
        for r, t in zip(group, mine, strict=False):
            r["timed_step_s"], r["timed_no_ac_step_s"], r["overhead"] = t, base_s, t / base_s - 1
    ours = next((r for r in rows if r["strategy"] == OURS and "overhead" in r), None)
    if ours is not None:
        rows.append(_within_target(planner, ours, data, out))
    return rows


def _within_target(planner: Planner, ours: dict, data, out: Path) -> dict:
    """trainplan's plan at the longest sequence (at most its longest) whose *measured* overhead
    is within OVERHEAD_TARGET, under the same cap: down the ladder from its longest sequence,
    each rung timed against no checkpointing, then a real run confirms the memory."""
    cap, mb = ours["cap_mib"] * MIB, ours["micro_batch"]
    row = dict(ours, strategy=OURS_FAST, max_seq=0, attempts="")
    if ours["overhead"] <= OVERHEAD_TARGET:
        return dict(row, max_seq=ours["max_seq"], attempts=f"{ours['max_seq']}:{ours['overhead']:+.1%} ")
    idx, margin = LADDER.index(ours["max_seq"]) - 1, ours["margin"]
    while idx >= 0:
        seq = LADDER[idx]
        choice = planner.plan(OURS, seq, mb, cap - margin)
        base = planner.plan("no_ac", seq, mb, float("inf"))
        if choice is None:
            break
        plan = _plan_for(planner, choice, seq, mb)
        t, tb = _interleaved_times([plan, _plan_for(planner, base, seq, mb)], data)
        row["attempts"] += f"{seq}:{t / tb - 1:+.1%}"
        if t / tb - 1 > OVERHEAD_TARGET:
            row["attempts"] += " "
            idx -= 1
            continue
        peak, flops = _run(plan, data, out / "runs" / f"cap{ours['cap_mib']}_mb{mb}_{OURS_FAST}_s{seq}")
        row["attempts"] += f",{peak / MIB:.2f}MiB "
        if peak > cap:  # overshot its prediction: the same rung again under the cap less that
            margin += peak - choice["peak"]
            continue
        row.update(max_seq=seq, seq=seq, predicted_peak_mib=choice["peak"] / MIB, measured_peak_mib=peak / MIB,
                   predicted_step_s=choice["step_s"], measured_flops=flops, margin=margin,
                   predicted_flops=plan.predictions.flops_per_step, timed_step_s=t,
                   timed_no_ac_step_s=tb, overhead=t / tb - 1,
                   predicted_overhead=choice["step_s"] / base["step_s"] - 1,
                   checkpoint="+".join(sorted(set(choice["policies"]))))
        break
    print(f"  cap {ours['cap_mib']} MiB mb {mb} {OURS_FAST:15s} trained {row['max_seq']:5d} "
          f"(overhead by rung: {row['attempts'].strip()})", flush=True)
    return row


def summarize(df: pd.DataFrame, quick: bool) -> dict:
    def by_case(name):
        return df[df.strategy == name].set_index(["cap_mib", "micro_batch"])

    ours, fast, noac = by_case(OURS), by_case(OURS_FAST), by_case("no_ac")
    ratios = ours["max_seq"] / noac["max_seq"]
    fast_ratios = fast["max_seq"] / noac["max_seq"]
    losses = 0  # a baseline trained a longer sequence under the same cap
    for (cap, mb), r in ours.iterrows():
        others = df[(df.cap_mib == cap) & (df.micro_batch == mb) & ~df.strategy.isin([OURS, OURS_FAST])]
        losses += int((others["max_seq"] > r["max_seq"]).sum())
    fast_ok = bool(fast_ratios.min() >= 2.7 and fast["overhead"].max() <= OVERHEAD_TARGET)
    return {
        "cases": int(len(ours)),
        "max_seq_ratio_vs_no_ac": float(ratios.min()),
        "overhead_at_max_seq": float(ours["overhead"].max()),
        "predicted_overhead_at_max_seq": float(ours["predicted_overhead"].max()),
        "max_seq_ratio_vs_no_ac_within_15pct": float(fast_ratios.min()),
        "overhead_at_max_seq_within_15pct": float(fast["overhead"].max()),
        "predicted_overhead_at_max_seq_within_15pct": float(fast["predicted_overhead"].max()),
        "losses_to_baselines": losses,
        "targets_met": bool(fast_ok and losses == 0),
        "quick": quick,
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one cap, fewer strategies: about two minutes")
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from executor.data.batches import load_corpus

    data = load_corpus(vocab_size=VOCAB)
    planner = Planner()
    rows = []
    t0 = time.perf_counter()
    for cap_mib, mb in CASES[a.quick]:
        timed = (OURS,) if a.quick else STRATEGIES[a.quick]  # whose overhead is timed
        rows += run_case(planner, cap_mib, mb, STRATEGIES[a.quick], data, out, timed)
    df = pd.DataFrame(rows)
    df.to_csv(out / "remat.csv", index=False)
    summary = summarize(df, a.quick) | {"wall_s": time.perf_counter() - t0}
    (out / "remat.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(df.reindex(columns=["cap_mib", "micro_batch", "strategy", "max_seq", "measured_peak_mib",
                              "predicted_overhead", "overhead", "checkpoint"]).to_string(index=False))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
