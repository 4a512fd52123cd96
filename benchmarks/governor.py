"""The compute governor against running the step budget out, on this machine's CPU.

    python benchmarks/governor.py [--quick] [--out DIR] [--jobs N] [--reuse] [--threads N]

Setting: tiny-llama (seq_len 128, micro-batch 8, vocab 8192, peak learning rate `LR`) on a
`data_fraction` subset of the default corpus, planned with a fixed step budget
(`planner.api.plan_for_choice` with the corpus's unique tokens): data-constrained, the subset
repeated for many epochs, the case where a fixed budget is wasteful. Every run is a real
`executor.train.run` (held-out loss every `eval_every` steps, warmup-stable-decay learning
rate).

1. Planner (before the run). The loss law is refitted to pilot runs, as `trainplan calibrate`
   would: short runs on smaller subsets (`PILOTS`), whose held-out curves in the constant-rate
   phase fit E, B, beta and R_D* of L = E + B / D'^beta, D' Muennighoff et al. 2023's effective
   tokens (`costmodels.data_value.fit_local_law(fit_r_d_star=True)`, as `benchmarks/data.py`).
   The threshold comes from a price (`value_steps_per_nat`); `planner.governor.with_governor`
   writes it into the plan with the predicted stop step: the governor's own rule simulated
   over the law's curve along the run, with the pilots' evaluation noise and the run's
   evaluation period (`costmodels.stopping.simulated_stop_step`: the governor waits for an
   upper confidence bound, so it stops later than the mean curve crosses the threshold).
2. Baseline: the plan without a governor, run to the end of its budget.
3. Governed run: the same plan with the governor on (`Governor.for_plan(plan, **GOVERNOR)`),
   live inside `executor.train.run`: it fits the held-out curve, decides, cools down and stops.
   Until the decision it is the baseline's run (same batches, same learning rates).
4. Control (full mode): a governed run on fresh data (fraction 1) at the same price of a nat,
   where the loss still falls at the end of its budget: the governor should run it out, and
   the plan should predict so.
5. A threshold sweep replays the governor over the baseline's record (no cooldown, `replay`
   rows): the decided step against the plan's prediction at other prices of a nat.

Figures (summary): compute_saved_frac = 1 - governed steps (cooldown included) / budget;
loss_given_up = (governed final held-out loss - baseline's) / baseline's (negative: the governed
run ends lower); stop_step_rel_err = |plan's predicted stop step - the step the governor decided
at| / the decided step. compute_saved_frac_incl_evals also charges the governed run for its
held-out evaluations (every `eval_every` steps, each `eval_cost_steps` training steps,
measured) against the 10 an ungoverned run makes; compute_saved_frac_incl_pilots also charges
it for the pilots (a one-off calibration that later plans reuse).

The price: a step costs 1 step of compute and one nat of held-out loss is worth
`value_steps_per_nat(max_steps)` steps, the issue's targets read as a price (30% of the budget
for 1% of a 6-nat loss): a step is worth taking while it lowers the loss by at least
1 / value nats (`costmodels.governor.threshold_from_value`).

Writes DIR/governor.csv (one row per run and per replayed threshold), DIR/governor.json (the
summary) and DIR/governor.png (both runs' held-out losses, the plan's predicted curve and band,
the governor's fit and band at its decision, budget, predicted and actual stop, final losses).
Runs go to DIR/runs/governor-*/ (`--reuse` takes finished runs whose plans match from there).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import platform
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from costmodels.data_value import fit_local_law
from costmodels.governor import threshold_from_value
from costmodels.loss import learning_curve
from executor.data import load_corpus
from executor.governor import Governor, curve_frame, plot_governor
from executor.record import RunRecord
from planner.api import plan_for_choice
from planner.governor import with_governor

SHAPE = dict(seq_len=128, micro_batch=8, vocab_size=8192)
LR = 1e-3
"""Peak learning rate of every run, as `benchmarks/data.py`'s: at `plan_for_choice`'s default
3e-3 tiny-llama sits on the unigram plateau (about 6.6 nats) for a data-dependent number of
steps and its held-out curves are far noisier; at 1e-3 they fall smoothly."""
FULL = dict(
    # the headline: a 41k-token subset (40 steps an epoch) repeated 10 times
    scenario=dict(data_fraction=0.03, max_steps=400, eval_every=10),
    # pilots (the planner's calibration): half and twice the headline's unique data, a quarter
    # of its budget each
    pilots=(dict(data_fraction=0.06, max_steps=100, eval_every=5),
            dict(data_fraction=0.015, max_steps=100, eval_every=5)),
    # fresh data (a tenth of an epoch): the loss still falls at the end
    control=dict(data_fraction=1.0, max_steps=150, eval_every=5),
)
QUICK = dict(
    scenario=dict(data_fraction=0.0075, max_steps=120, eval_every=5),
    pilots=(dict(data_fraction=0.015, max_steps=40, eval_every=5),
            dict(data_fraction=0.00375, max_steps=40, eval_every=5)),
    control=None,
)
GOVERNOR = dict(refit_every=10, min_points=8, confidence=0.9)
"""The governor's settings beside the plan's threshold, budget and warm-up (its defaults)."""
TARGETS = dict(compute_saved_frac=0.30, loss_given_up=0.01, stop_step_rel_err=0.15)
REFERENCE_LOSS_NATS = 6.0
"""Order of the held-out loss these runs reach (nats/token), to price the targets."""
SWEEP = (0.5, 2.0, 5.0)
"""Multiples of the headline value of a nat replayed over the baseline."""
DEFAULT_EVALS = 10
"""Held-out evaluations an ungoverned run makes (`run`'s default: every max_steps // 10)."""
REUSED: list[str] = []


def value_steps_per_nat(max_steps: int) -> float:
    """The price of a nat of held-out loss, in steps: the issue's targets read as a price, 30%
    of the budget for 1% of a REFERENCE_LOSS_NATS loss (400 steps: 2,000 steps per nat, a
    threshold of 5e-4 nats/step)."""
    return TARGETS["compute_saved_frac"] * max_steps / (TARGETS["loss_given_up"] * REFERENCE_LOSS_NATS)


def make_plan(cfg: dict, data_tokens: int, law=None):
    """The plan of one run: fixed knobs, the corpus's unique tokens, `law` for its predictions."""
    return plan_for_choice("tiny-llama", "cpu", **SHAPE, max_steps=cfg["max_steps"], lr=LR,
                           data_fraction=cfg["data_fraction"], data_tokens=data_tokens, law=law)


def reused(plan, run_dir: Path):
    """The finished run's record in `run_dir` when it ran the same decisions, else None."""
    from planner.plan import Plan

    try:
        old, rec = Plan.from_json(run_dir / "plan.json"), RunRecord.from_json(run_dir / "record.json")
    except Exception:  # noqa: BLE001 -- anything unreadable means: run it again
        return None
    done = rec.stop_reason in ("budget", "marginal_gain")
    return rec if old.decisions == plan.decisions and done else None


def run_job(plan_json: str, out: str, eval_every: int, governed: bool, threads: int) -> str:
    """One real run (in this process or a worker): the record as JSON text."""
    from executor.train import run
    from planner.plan import Plan

    torch.set_num_threads(threads)
    plan = Plan.from_json(plan_json)
    shutil.rmtree(out, ignore_errors=True)
    gov = Governor.for_plan(plan, **GOVERNOR) if governed else None
    rec = run(plan, data=load_corpus(vocab_size=SHAPE["vocab_size"]), out=out, progress=False,
              eval_every=eval_every, governor=gov)
    return rec.to_json()


def get_run(plan, run_dir: Path, eval_every: int, a, *, governed: bool, pool=None):
    """The record of `plan` run in `run_dir` (reused with --reuse when it matches); with a
    `pool`, a future of it."""
    rec = reused(plan, run_dir) if a.reuse else None
    if rec is not None:
        REUSED.append(run_dir.name)
        return rec
    args = (plan.to_json(), str(run_dir), eval_every, governed, a.threads)
    if pool is not None:
        return pool.submit(run_job, *args)
    return RunRecord.from_json(run_job(*args))


def _result(x) -> RunRecord:
    return x if isinstance(x, RunRecord) else RunRecord.from_json(x.result())


def constant_rate_points(plan, rec: RunRecord):
    """Held-out (steps, loss) of a run after warm-up and before its cooldown (last 20%)."""
    d = plan.decisions
    return [(s, v) for s, _, v in rec.heldout_loss if d.warmup_steps < s <= 0.8 * d.max_steps]


def fit_pilot_law(pilots, data_tokens: int, n_params: int, tokens_per_step: int):
    """E, B, beta, R_D* of the local law from the pilots' constant-rate held-out curves; the
    law's RMS residual over them (nats), the band of its predicted curve; and the evaluation
    noise (nats): the median over pilots of the noise scale from second differences
    (`costmodels.governor._noise_scale`, robust to the curve's trend)."""
    from costmodels.governor import _noise_scale

    seen, unique, losses, noise = [], [], [], []
    for plan, rec in pilots:
        pts = constant_rate_points(plan, rec)
        noise.append(_noise_scale(np.array([v for _, v in pts])))
        for s, v in pts:
            seen.append(s * tokens_per_step)
            unique.append(plan.decisions.data_fraction * data_tokens)
            losses.append(v)
    law = fit_local_law(n_params, seen, unique, losses, fit_r_d_star=True)
    pred = np.array([learning_curve([t], law=law, n_params=n_params, unique_tokens=u)[0]
                     for t, u in zip(seen, unique)])
    rms = float(np.sqrt(np.mean((pred - np.array(losses)) ** 2)))
    law = dataclasses.replace(law, source=f"fit to {len(pilots)} pilot runs' held-out curves "
                                          f"({len(losses)} points); {law.source}")
    return law, rms, float(np.median(noise))


def eval_cost_steps(record: RunRecord) -> float:
    """Cost of one held-out evaluation in median training steps, measured on `record`: the wall
    time outside the timed steps (the two untimed measurement steps counted as two median
    steps, though they take longer: an overestimate) per evaluation."""
    med = record.median_step_time_s
    rest = record.wall_s - sum(record.step_times_s) - 2 * med
    return max(rest, 0.0) / max(len(record.heldout_loss), 1) / med


def governor_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "governor.json").read_text())


def run_row(name: str, plan, rec: RunRecord, summary: dict | None = None) -> dict:
    d, p = plan.decisions, plan.predictions
    s = summary or {}
    return {"run": name, "mode": "live", "data_fraction": d.data_fraction, "max_steps": d.max_steps,
            "threshold_nats_per_step": d.governor_threshold, "steps": rec.steps,
            "stop_reason": rec.stop_reason, "stop_step_decided": s.get("decided_at"),
            "stop_step_predicted": p.predicted_stop_step, "end_step_predicted": p.predicted_end_step,
            "final_heldout_loss": rec.final_heldout_loss, "end_loss_predicted": p.predicted_end_loss,
            "wall_s": rec.wall_s, "median_step_time_s": rec.median_step_time_s}


def governed_plan(cfg: dict, data_tokens: int, law, noise: float, threshold: float):
    """The plan with the governor on at `threshold`, its stop predicted by the governor's rule
    simulated over the law's curve with the pilots' evaluation noise and this run's evaluation
    period (`planner.governor.with_governor`)."""
    return with_governor(make_plan(cfg, data_tokens, law), threshold_nats_per_step=threshold, law=law,
                         noise_nats=noise, eval_every=cfg["eval_every"], governor_settings=GOVERNOR)


def sweep_rows(cfg: dict, data_tokens: int, base: RunRecord, law, noise: float,
               value: float) -> list[dict]:
    """The governor replayed over the baseline at other prices of a nat (no cooldown: the
    decided step only), beside the plan's predicted stop at each."""
    rows = []
    for mult in SWEEP:
        thr = threshold_from_value(value_per_nat=value * mult, cost_per_step=1.0)
        p = governed_plan(cfg, data_tokens, law, noise, thr)
        gov = Governor.for_plan(p, **GOVERNOR)
        dec = gov.replay(base.train_loss, base.heldout_loss)
        decided = dec.cooldown_start if dec.reason == "marginal_gain" else dec.steps
        pred = p.predictions.predicted_stop_step
        rows.append({"run": f"replay x{mult:g}", "mode": "replay over the baseline",
                     "data_fraction": p.decisions.data_fraction, "max_steps": p.decisions.max_steps,
                     "threshold_nats_per_step": thr, "stop_reason": dec.reason,
                     "stop_step_decided": decided, "stop_step_predicted": pred,
                     "stop_step_rel_err": abs(pred - decided) / decided})
    return rows


def plan_curve(plan, law, rms: float) -> pd.DataFrame:
    """The plan's predicted held-out curve along its budget (the pilots' law) +- its RMS."""
    d, p = plan.decisions, plan.predictions
    steps = np.arange(max(d.warmup_steps, 1), d.max_steps + 1)
    loss = learning_curve(steps * p.tokens_per_step, law=law, n_params=plan.model_n_params,
                          unique_tokens=plan.data_tokens * d.data_fraction)
    return pd.DataFrame({"steps": steps, "loss": loss, "lower": loss - rms, "upper": loss + rms})


def figure(plan, base: RunRecord, gov_rec: RunRecord, summary: dict, curve: pd.DataFrame,
           path: Path) -> None:
    from matplotlib.figure import Figure

    n = plan.decisions.max_steps
    s = summary | {"predicted_stop_step": plan.predictions.predicted_stop_step}
    fig = Figure(figsize=(8.5, 7))
    ax = fig.add_subplot()
    ax.plot([r[0] for r in base.heldout_loss], [r[2] for r in base.heldout_loss], "-", color="0.6",
            lw=1, label="held-out loss, budget run out (baseline)")
    ax.plot(curve["steps"], curve["loss"], "--", color="C2", lw=1.2,
            label="plan's predicted curve (law fitted to pilots)")
    ax.fill_between(curve["steps"], curve["lower"], curve["upper"], color="C2", alpha=0.12,
                    label="± RMS of the law's fit")
    plot_governor(ax, curve_frame(gov_rec.heldout_loss, s, max_steps=n), s, max_steps=n,
                  final_losses={"governed run": (gov_rec.steps, gov_rec.final_heldout_loss),
                                "budget run out": (base.steps, base.final_heldout_loss)},
                  predicted_label="predicted stop (plan)")
    ax.set_title(f"governor: tiny-llama, {plan.decisions.data_fraction:g} of the corpus, {n}-step "
                 f"budget, threshold {plan.decisions.governor_threshold:.2g} nats/step\n"
                 f"stop predicted at step {plan.predictions.predicted_stop_step}, decided at "
                 f"{summary['decided_at']}, run ended at {gov_rec.steps}", fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smaller setting, about three minutes")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--jobs", type=int, default=2,
                    help="processes (2: the baseline runs beside the pilots and the governed run)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per process (small GEMMs under contention are slower with more)")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse the finished runs in DIR/runs/ whose plans are the same")
    a = ap.parse_args(argv)
    cfg = QUICK if a.quick else FULL
    out = Path(a.out)
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(a.threads)
    t_start = time.perf_counter()
    data_tokens = load_corpus(vocab_size=SHAPE["vocab_size"]).n_train_tokens
    sc = cfg["scenario"]
    n, every = sc["max_steps"], sc["eval_every"]
    value = value_steps_per_nat(n)
    threshold = threshold_from_value(value_per_nat=value, cost_per_step=1.0)
    tag = "quick-" if a.quick else ""

    pool = (ProcessPoolExecutor(1, mp_context=get_context("spawn")) if a.jobs > 1 else None)
    try:
        # 2. the baseline: no governor (in a worker with --jobs 2)
        base_plan = make_plan(sc, data_tokens)
        base_fut = get_run(base_plan, runs / f"governor-{tag}baseline", every, a, governed=False, pool=pool)
        # 1. the planner: pilots, the law, the threshold and the predicted stop
        pilots = []
        for i, pc in enumerate(cfg["pilots"]):
            pplan = make_plan(pc, data_tokens)
            pilots.append((pplan, get_run(pplan, runs / f"governor-{tag}pilot{i}", pc["eval_every"], a,
                                          governed=False)))
            print(f"pilot {i}: fraction {pc['data_fraction']}, {pc['max_steps']} steps, final held-out "
                  f"{pilots[-1][1].final_heldout_loss:.4f}", flush=True)
        tps = base_plan.predictions.tokens_per_step
        law, rms, noise = fit_pilot_law(pilots, data_tokens, base_plan.model_n_params, tps)
        plan = governed_plan(sc, data_tokens, law, noise, threshold)
        pr = plan.predictions
        print(f"law: E={law.E:.3f} B={law.B:.3g} beta={law.beta:.3f} R_D*={law.r_d_star:.3g} "
              f"(RMS {rms:.3f} nats), evaluation noise {noise:.3f} nats; threshold {threshold:.2g} "
              f"nats/step; predicted stop at step {pr.predicted_stop_step}, end "
              f"{pr.predicted_end_step}, loss {pr.predicted_end_loss:.4f}", flush=True)
        # 4. the control, fresh data, at the same price of a nat (queued behind the baseline)
        control = None
        if cfg["control"]:
            cc = cfg["control"]
            cplan = governed_plan(cc, data_tokens, law, noise, threshold)
            cdir = runs / f"governor-{tag}control"
            control = (cplan, get_run(cplan, cdir, cc["eval_every"], a, governed=True, pool=pool), cdir)
        # 3. the governed run, live
        gdir = runs / f"governor-{tag}governed"
        grec = get_run(plan, gdir, every, a, governed=True)
        summary = governor_summary(gdir)
        print(f"governed: {grec.stop_reason} decided at {summary['decided_at']}, ended at {grec.steps}, "
              f"final held-out {grec.final_heldout_loss:.4f}", flush=True)
        base = _result(base_fut)
        print(f"baseline: {base.steps} steps, final held-out {base.final_heldout_loss:.4f}", flush=True)
        if control:
            cplan, crec, cdir = control
            control = (cplan, _result(crec), governor_summary(cdir))
            print(f"control (fresh data): {control[1].stop_reason} after {control[1].steps} of "
                  f"{cplan.decisions.max_steps} steps; plan predicted "
                  f"{cplan.predictions.predicted_stop_step}", flush=True)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)

    rows = [run_row(f"pilot{i}", p, r) for i, (p, r) in enumerate(pilots)]
    rows += [run_row("baseline", base_plan, base), run_row("governed", plan, grec, summary)]
    if control:
        rows.append(run_row("control (fresh data)", *control))
    rows += sweep_rows(sc, data_tokens, base, law, noise, value)
    pd.DataFrame(rows).to_csv(out / "governor.csv", index=False)

    decided = summary["decided_at"] if grec.stop_reason == "marginal_gain" else grec.steps
    e = eval_cost_steps(base)
    pilot_steps = sum(r.steps + len(r.heldout_loss) * e for _, r in pilots)  # evaluations included
    governed_cost = grec.steps + (grec.steps // every) * e
    budget_cost = n + DEFAULT_EVALS * e
    head = {
        "compute_saved_frac": 1.0 - grec.steps / n,
        "loss_given_up": (grec.final_heldout_loss - base.final_heldout_loss) / base.final_heldout_loss,
        "stop_step_rel_err": abs(pr.predicted_stop_step - decided) / decided,
    }
    summary_out = {
        **head,
        "targets_met": bool(head["compute_saved_frac"] >= TARGETS["compute_saved_frac"]
                            and head["loss_given_up"] <= TARGETS["loss_given_up"]
                            and head["stop_step_rel_err"] <= TARGETS["stop_step_rel_err"]),
        "reason": grec.stop_reason, "stop_step_decided": decided, "final_step": grec.steps,
        "stop_step_predicted": pr.predicted_stop_step, "end_step_predicted": pr.predicted_end_step,
        "end_step_rel_err": abs(pr.predicted_end_step - grec.steps) / grec.steps,
        "governor_fit_predicted_stop_step": summary.get("predicted_stop_step"),
        "baseline_final_loss": base.final_heldout_loss, "governed_final_loss": grec.final_heldout_loss,
        "end_loss_predicted": pr.predicted_end_loss,
        "compute_saved_frac_incl_evals": 1.0 - governed_cost / budget_cost,
        "compute_saved_frac_incl_pilots": 1.0 - (governed_cost + pilot_steps) / budget_cost,
        "eval_cost_steps": e, "pilot_steps": pilot_steps,
        "threshold_nats_per_step": threshold, "value_steps_per_nat": value, "max_steps": n,
        "data_fraction": sc["data_fraction"], "eval_every": every, "lr": LR,
        "law_E": law.E, "law_B": law.B, "law_beta": law.beta, "law_r_d_star": law.r_d_star,
        "law_rms_nats": rms, "eval_noise_nats": noise,
        "sweep_stop_step_rel_err_max": max(r["stop_step_rel_err"] for r in rows if r["mode"] != "live"),
    }
    if control:
        cplan, crec, _ = control
        summary_out |= {"control_reason": crec.stop_reason, "control_steps": crec.steps,
                        "control_max_steps": cplan.decisions.max_steps,
                        "control_stop_step_predicted": cplan.predictions.predicted_stop_step}
    summary_out |= {
        "wall_s": time.perf_counter() - t_start,
        "runs_wall_s": sum(r["wall_s"] for r in rows if r["mode"] == "live"),
        "reused_runs": ", ".join(REUSED),
        "quick": a.quick,
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                   f"{a.threads} thread(s) x {a.jobs} process(es)",
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    summary_out = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in summary_out.items()}
    figure(plan, base, grec, summary, plan_curve(plan, law, rms), out / "governor.png")
    (out / "governor.json").write_text(json.dumps(summary_out, indent=2) + "\n")
    print(json.dumps(summary_out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
