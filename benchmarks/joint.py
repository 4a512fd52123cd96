"""The joint plan against tuning one knob at a time, at a fixed budget.

    python benchmarks/joint.py [--quick | --smoke] [--no-measure] [--reuse] [--out DIR]

`--smoke`: the tiny-llama case alone at the FLOPs of one default step (a few measured steps),
one held-out evaluation of one micro-batch in the runs and one batch of 16 windows after them;
the same code path and output files, for the test suite.

For each case (model, hardware, devices, sequence, budget, optionally a memory cap) three kinds
of plan, all predicted by the same cost models (`StepModel.evaluate`: peak bytes per device and
step cost; the loss law with the optimizer-width penalty, at the tokens the budget buys when
the plan runs it out):

- joint: `trainplan.planner.joint.problem.solve_problem`, every knob in one CP-SAT model;
- defaults: what a user starts from: full activation checkpointing, the default precision
  (bf16 mixed on accelerators, fp32 on CPU), 32-bit AdamW, all the data, SP degree 1, ZeRO-3
  (FSDP) on more than one device, the largest micro-batch that fits under full checkpointing,
  the budget run out;
- per-knob greedy (coordinate descent): from the defaults, for each knob in turn (SP degree,
  ZeRO stage, micro-batch, checkpointing with every block on one named policy, optimizer bits,
  data fraction) take the value with the lowest predicted loss, the others fixed (a tie keeps
  the current value); every one of the 720 orders of the six knobs. `greedy_best` is the best
  of them, `greedy_worst` the worst; `only_<knob>` tunes that one knob alone.

A plan that does not fit memory or buys no step has infinite loss. The cases are built so that
the knobs interact: a memory cap or a long sequence makes full checkpointing the only way the
default micro-batch fits, and recompute costs tokens under a fixed budget, so leaving it takes
a smaller micro-batch at the same time, a move no single knob makes.

Measured (not with --no-measure): tiny-llama on this CPU at a small FLOP budget (each run about
two minutes; `--quick`: a few steps): the joint plan and the best per-knob plan run for real
(`trainplan.executor.train.run`, same seed and data), and their final held-out loss is measured on the
same 128 held-out windows (`trainplan.executor.data.batches.heldout_batches`, micro-batch 16) after training. The
memory cap is a what-if on the CPU (it is not enforced there); FLOPs are the budget, so the
runs are at equal compute.

Summary keys: `joint_vs_best_single_knob_loss_delta` (measured held-out loss of the joint plan
minus the best per-knob plan's, nats; negative when the joint plan wins),
`joint_vs_best_single_knob_pred_delta_max` (predicted, over the cases), `joint_never_worse`
(the joint plan's predicted loss is at most the best per-knob plan's and the defaults' in every
predicted case). Writes DIR/joint.csv (one row per case and plan) and DIR/joint.json, prints the
summary last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import math
import platform
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from trainplan.costmodels.loss.law import LossLaw
from trainplan.costmodels.loss.planned import run_loss

KNOBS = ("sp_degree", "zero_stage", "micro_batch", "checkpoint", "optimizer_bits", "data_fraction")
CHECKPOINTS = ("none", "save_matmuls", "save_attention", "full")
TOL = 1e-9
GIB = 2**30

TINY = dict(name="tiny-llama cpu, 512 MiB cap", model="tiny-llama", hw="cpu", devices=1, seq_len=256,
            budget=dict(default_steps=30), memory_limit_bytes=512 * 2**20, vocab_size=8192,
            micro_batches=(4, 8, 16), law=dict(E=2.9, A=0.0, B=15.0, beta=0.12, b_crit_tokens=4e4))
"""`law`: the published law is clipped at ln(8192) for a 7M model (every plan would tie), so the
tiny case plans with a law of the local form (`trainplan.costmodels.loss.pilots`; constants of the order
this repo's pilots fit, not fitted to this case)."""
"""The measured case: 512 MiB per device lets micro-batch 16 fit only with (almost) full
checkpointing, while no checkpointing fits at micro-batch 8 (predicted peaks). The budget is
FLOPs: `default_steps` steps of the default plan (micro-batch 16, full checkpointing; 1.6e11
FLOPs a step), a budget a user of that plan would state. Micro-batches of at least 4 (for
joint and per-knob plans alike): smaller ones run far below the CPU's throughput."""
CASES = [
    TINY,
    dict(name="llama3-8b 8xh100 8k", model="llama3-8b", hw="h100", devices=8, seq_len=8192,
         budget=dict(device_hours=2000.0)),
    dict(name="llama3-8b 8xh100 8k, 40 GiB cap", model="llama3-8b", hw="h100", devices=8,
         seq_len=8192, budget=dict(device_hours=2000.0), memory_limit_bytes=40 * GIB),
    dict(name="llama3-70b 64xh100 8k", model="llama3-70b", hw="h100", devices=64, seq_len=8192,
         budget=dict(device_hours=50000.0)),
    dict(name="llama3-70b 8xmi300 128k", model="llama3-70b", hw="mi300", devices=8, seq_len=131072,
         budget=dict(device_hours=5000.0)),
    dict(name="llama3.1-405b 1024xmi300 8k", model="llama3.1-405b", hw="mi300", devices=1024,
         seq_len=8192, budget=dict(device_hours=1e6)),
]
QUICK = (0, 2)
SMOKE = (0,)


class Knobs:
    """Predicted loss of uniform plans (every block on one named checkpoint policy) for one
    problem, budget and memory cap; step costs cached over the knobs that shape a step."""

    def __init__(self, pr, budget, *, memory_limit_bytes: float | None = None):
        self.pr, self.budget = pr, budget
        self.space = pr.space(budget.devices)
        self.limit = min(pr.profile.usable_bytes, memory_limit_bytes or math.inf)
        self.values = {"sp_degree": self.space.sp_degrees, "zero_stage": self.space.zero_stages,
                       "micro_batch": self.space.micro_batches, "checkpoint": CHECKPOINTS,
                       "optimizer_bits": self.space.optimizer_bits,
                       "data_fraction": tuple(sorted(self.space.data_fractions))}
        self._steps: dict[tuple, tuple[float, float]] = {}

    def choice(self, k: dict):
        from trainplan.costmodels.step.model import Choice

        L = len(self.pr.step_model.blocks)
        return Choice(sp_degree=k["sp_degree"], zero_stage=k["zero_stage"], micro_batch=k["micro_batch"],
                      seq_len=self.pr.seq_len, policies=(k["checkpoint"],) * L,
                      precision=self.space.precision, optimizer_bits=k["optimizer_bits"],
                      devices=self.budget.devices)

    def step(self, k: dict) -> tuple[float, float]:
        """(peak bytes per device, steps the budget buys) at knobs k."""
        key = tuple(k[x] for x in KNOBS if x != "data_fraction")
        if key not in self._steps:
            cost = self.pr.step_model.evaluate(self.choice(k))
            b, d = self.budget, self.budget.devices
            if b.flops is not None:
                steps = math.floor(b.flops / (cost.flops * d))
            else:
                steps = math.floor(b.wall_s_for(d) / cost.time_s)
            self._steps[key] = (cost.memory.total, steps)
        return self._steps[key]

    def loss(self, k: dict) -> float:
        """Predicted final loss (nats/token) when the budget is run out; inf if it does not fit."""
        from trainplan.costmodels.loss.bits import bits_loss_penalty

        mem, steps = self.step(k)
        if mem > self.limit or steps < 1:
            return math.inf
        tokens = steps * k["micro_batch"] * self.pr.seq_len * (self.budget.devices // k["sp_degree"])
        return (run_loss(self.pr.law, self.pr.graph.law_n_params, steps=steps, tokens_per_step=tokens // steps,
                         unique_tokens=max(1.0, k["data_fraction"] * self.pr.unique))
                + bits_loss_penalty(k["optimizer_bits"]))

    def tokens(self, k: dict) -> int:
        return self.step(k)[1] * k["micro_batch"] * self.pr.seq_len * (self.budget.devices // k["sp_degree"])

    def defaults(self) -> dict:
        """Full checkpointing, 32-bit AdamW, all data, SP 1, ZeRO-3 on several devices, the
        largest micro-batch that fits under full checkpointing (else the smallest)."""
        k = dict(sp_degree=1, zero_stage=max(self.space.zero_stages) if self.budget.devices > 1 else 0,
                 checkpoint="full", optimizer_bits=32 if 32 in self.space.optimizer_bits
                 else max(self.space.optimizer_bits), data_fraction=max(self.space.data_fractions),
                 micro_batch=min(self.space.micro_batches))
        fits = [mb for mb in self.space.micro_batches if self.step(k | {"micro_batch": mb})[0] <= self.limit]
        return k | {"micro_batch": max(fits)} if fits else k

    def greedy(self, order, start: dict | None = None) -> dict:
        """Coordinate descent over `order`, one pass, ties keeping the current value."""
        k = dict(start or self.defaults())
        for knob in order:
            best = self.loss(k)
            for v in self.values[knob]:
                got = self.loss(k | {knob: v})
                if got < best - TOL:
                    best, k = got, k | {knob: v}
        return k


def per_knob_plans(kn: Knobs) -> dict[str, tuple[dict, float, str]]:
    """{method: (knobs, predicted loss, note)} for defaults, only_<knob>, greedy best/worst."""
    d = kn.defaults()
    out = {"defaults": (d, kn.loss(d), "")}
    for knob in KNOBS:
        k = kn.greedy((knob,), d)
        out[f"only_{knob}"] = (k, kn.loss(k), "")
    runs = [(order, kn.greedy(order, d)) for order in itertools.permutations(KNOBS)]
    scored = sorted(((kn.loss(k), i) for i, (_, k) in enumerate(runs)))
    (lo, ib), (hi, iw) = scored[0], scored[-1]
    n_best = sum(1 for v, _ in scored if v <= lo + TOL)
    out["greedy_best"] = (runs[ib][1], lo, f"order {' > '.join(runs[ib][0])}; {n_best} of {len(runs)} orders reach it")
    out["greedy_worst"] = (runs[iw][1], hi, f"order {' > '.join(runs[iw][0])}")
    return out


def case_rows(case: dict) -> tuple[list[dict], dict]:
    """Predicted rows of one case and the plans to run (`joint`, `greedy_best` as Plans)."""
    from trainplan.planner.api import plan_for_choice
    from trainplan.planner.budget import Budget
    from trainplan.planner.joint.problem import prepare, solve_problem

    data_tokens = case.get("data_tokens")
    pr = prepare(case["model"], case["hw"], seq_len=case["seq_len"], data_tokens=data_tokens,
                 vocab_size=case.get("vocab_size"), law=LossLaw(**case["law"]) if "law" in case else None,
                 **({"micro_batches": case["micro_batches"]} if "micro_batches" in case else {}))
    cap = case.get("memory_limit_bytes")
    if "default_steps" in case["budget"]:  # FLOPs of that many steps of the default plan
        probe = Knobs(pr, Budget(devices=case["devices"], flops=1.0), memory_limit_bytes=cap)
        step = pr.step_model.runtime(probe.choice(probe.defaults())).flops * case["devices"]
        budget = Budget(devices=case["devices"], flops=case["budget"]["default_steps"] * step)
    else:
        budget = Budget(devices=case["devices"], **case["budget"])
    t0 = time.perf_counter()
    joint = solve_problem(pr, budget, memory_limit_bytes=cap)
    solve_s = time.perf_counter() - t0
    kn = Knobs(pr, budget, memory_limit_bytes=cap)
    t0 = time.perf_counter()
    plans = per_knob_plans(kn)
    greedy_s = time.perf_counter() - t0
    d, p = joint.decisions, joint.predictions
    base = dict(case=case["name"], model=case["model"], hw=case["hw"], devices=case["devices"],
                seq_len=case["seq_len"], budget=json.dumps(budget.to_dict()),
                memory_limit_gib=(cap or pr.profile.usable_bytes) / GIB)
    ck = ", ".join(f"{d.activation_checkpoint.count(e)} x {e}" for e in dict.fromkeys(d.activation_checkpoint))
    rows = [base | dict(method="joint", sp_degree=d.sp_degree, zero_stage=d.zero_stage,
                        micro_batch=d.micro_batch, checkpoint=ck, optimizer_bits=d.optimizer_bits,
                        data_fraction=d.data_fraction, tokens=p.total_tokens,
                        memory_gib=p.memory_bytes["total"] / GIB,
                        fits=p.memory_bytes["total"] <= kn.limit * (1 + 1e-9),
                        predicted_loss=p.final_loss, note=f"{joint.solver.status}, {solve_s:.1f} s",
                        wall_s=solve_s)]
    for method, (k, loss, note) in plans.items():
        mem, _ = kn.step(k)
        rows.append(base | dict(method=method, **{x: k[x] for x in KNOBS if x != "checkpoint"},
                                checkpoint=f"{len(pr.step_model.blocks)} x {k['checkpoint']}",
                                tokens=kn.tokens(k) if math.isfinite(loss) else 0, memory_gib=mem / GIB,
                                fits=mem <= kn.limit, predicted_loss=loss, note=note,
                                wall_s=greedy_s if method == "greedy_best" else math.nan))
    for r in rows:
        r["pred_delta_vs_joint"] = r["predicted_loss"] - p.final_loss
    best_k = plans["greedy_best"][0]
    runnable = {"joint": joint}
    if math.isfinite(plans["greedy_best"][1]):
        steps = kn.step(best_k)[1]
        runnable["greedy_best"] = plan_for_choice(
            case["model"], case["hw"], seq_len=case["seq_len"], micro_batch=best_k["micro_batch"],
            activation_checkpoint=best_k["checkpoint"], sp_degree=best_k["sp_degree"], devices=case["devices"],
            zero_stage=best_k["zero_stage"], optimizer_bits=best_k["optimizer_bits"],
            data_fraction=best_k["data_fraction"], max_steps=steps, data_tokens=data_tokens,
            vocab_size=case.get("vocab_size"), law=pr.law, seed=d.seed)
    return rows, runnable


def _decisions(plan) -> dict:
    return json.loads(plan.to_json())["decisions"]


def measure(plans: dict, out: Path, reuse: bool = False, smoke: bool = False) -> dict[str, dict]:
    """Run each plan for real on this CPU; {method: final held-out loss on the same windows,
    steps, tokens, wall seconds, stop reason}. Each run folder keeps them in `heldout.json`;
    `reuse` takes them from there when the folder's plan has the same decisions. `smoke`: the
    runs evaluate one micro-batch at their last step, the final loss is on one batch of 16."""
    from trainplan.executor.data.batches import heldout_batches, load_corpus
    from trainplan.executor.train import run
    from trainplan.modeling.loss import lm_loss
    from trainplan.modeling.presets import build_model

    data = load_corpus(vocab_size=TINY["vocab_size"])
    held = heldout_batches(data.heldout_tokens, seq_len=TINY["seq_len"], micro_batch=16,
                          max_batches=1 if smoke else 8)
    got = {}
    for method, plan in plans.items():
        run_dir = out / "runs" / f"joint-{method}"
        saved = run_dir / "heldout.json"
        if reuse and saved.is_file():
            old = json.loads(saved.read_text())
            if old.pop("decisions", None) == _decisions(plan):
                got[method] = old
                print(f"  measured {method}: reused {run_dir}", flush=True)
                continue
        model = build_model(plan.model, device="cpu", vocab_size=data.vocab_size, seed=plan.decisions.seed)
        t0 = time.perf_counter()
        evals = dict(eval_every=plan.decisions.max_steps,
                     eval_tokens=TINY["seq_len"] * plan.decisions.micro_batch) if smoke else {}
        rec = run(plan, model=model, data=data, out=run_dir, progress=False, **evals)
        model.eval()
        with torch.no_grad():
            loss = sum(lm_loss(model(input_ids=x).logits, y).item() for x, y in held) / len(held)
        got[method] = dict(measured_heldout_loss=loss, measured_steps=rec.steps,
                           measured_tokens=rec.tokens, measured_wall_s=time.perf_counter() - t0,
                           stop_reason=rec.stop_reason)
        saved.write_text(json.dumps(got[method] | {"decisions": _decisions(plan)}, indent=2) + "\n")
        print(f"  measured {method}: {rec.steps} steps, held-out loss {loss:.4f} nats "
              f"({got[method]['measured_wall_s']:.0f} s)", flush=True)
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two small cases, a few measured steps")
    ap.add_argument("--smoke", action="store_true",
                    help="the tiny-llama case, a few measured steps: for the test suite")
    ap.add_argument("--no-measure", action="store_true", help="predicted figures only")
    ap.add_argument("--reuse", action="store_true",
                    help="take measured runs from DIR/runs/joint-*/heldout.json when their plans match")
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    t_start = time.perf_counter()
    from trainplan.executor.data.batches import count_corpus_tokens

    TINY["data_tokens"] = count_corpus_tokens(vocab_size=TINY["vocab_size"])
    if a.quick or a.smoke:
        TINY["budget"] = dict(default_steps=1 if a.smoke else 8)
    rows, measured = [], {}
    for i, case in enumerate(CASES):
        if (a.quick and i not in QUICK) or (a.smoke and i not in SMOKE):
            continue
        case_out, runnable = case_rows(case)
        j = case_out[0]
        g = next(r for r in case_out if r["method"] == "greedy_best")
        print(f"{case['name']}: joint {j['predicted_loss']:.4f} ({j['checkpoint']}, mb {j['micro_batch']}), "
              f"best per-knob {g['predicted_loss']:.4f} ({g['checkpoint']}, mb {g['micro_batch']}), "
              f"defaults {case_out[1]['predicted_loss']:.4f}", flush=True)
        if case is TINY and not a.no_measure:
            measured = measure(runnable, out, reuse=a.reuse, smoke=a.smoke)
            for r in case_out:
                r.update(measured.get(r["method"], {}))
        rows += case_out
    df = pd.DataFrame(rows)
    df.to_csv(out / "joint.csv", index=False)
    pred = df[df["method"].isin(["joint", "greedy_best", "defaults"])].pivot_table(
        index="case", columns="method", values="predicted_loss", sort=False)
    never_worse = bool(((pred["joint"] <= pred["greedy_best"] + 1e-6)
                        & (pred["joint"] <= pred["defaults"] + 1e-6)).all())
    delta = (measured["joint"]["measured_heldout_loss"] - measured["greedy_best"]["measured_heldout_loss"]
             if {"joint", "greedy_best"} <= set(measured) else None)
    summary = {
        "joint_vs_best_single_knob_loss_delta": delta,
        "joint_never_worse": never_worse,
        "joint_vs_best_single_knob_pred_delta_max": float((pred["joint"] - pred["greedy_best"]).max()),
        "joint_vs_best_single_knob_pred_delta_min": float((pred["joint"] - pred["greedy_best"]).min()),
        "joint_vs_defaults_pred_delta_min": float((pred["joint"] - pred["defaults"])[
            pred["defaults"] < math.inf].min()),
        "defaults_infeasible_cases": int((pred["defaults"] == math.inf).sum()),
        "joint_plans_fit_memory": bool(df[df["method"] == "joint"]["fits"].all()),
        "cases": len(pred),
        "wall_s": time.perf_counter() - t_start,
        "quick": a.quick,
        "smoke": a.smoke,
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                   f"{torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    if measured:
        summary |= {f"measured_heldout_loss_{m}": v["measured_heldout_loss"] for m, v in measured.items()}
        summary |= {f"measured_steps_{m}": v["measured_steps"] for m, v in measured.items()}
    summary = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in summary.items()}
    (out / "joint.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
