"""The compute governor against running the step budget out, on this machine's CPU.

    python benchmarks/governor.py [--quick] [--out DIR] [--live] [--no-confirm] [--reuse]
                                  [--threads N]

1. Baseline: tiny-llama (seq_len 128, micro-batch 8, vocab 8192) planned with a fixed step budget
   (`planner.api.plan_for_choice`) and run for real to the end (`executor.train.run`, held-out
   loss every `eval_every` steps, warmup-stable-decay learning rate with the planned cooldown
   over the last 20%). The scenario is data-constrained, the case where a fixed budget is
   wasteful: a `data_fraction` subset of the corpus repeated for several epochs, so that the
   held-out loss flattens (and then rises) well before the budget ends. A control scenario
   (full mode only) trains on fresh data, where the loss still falls at the end of the budget
   and the governor should not stop.
2. Governor: `executor.governor.Governor` replayed step by step over the baseline's recorded
   train and held-out losses, exactly as the live loop would feed it: until the stop decision
   the governed run and the baseline are the same run (same batches, same learning rates).
3. The governed run, cooldown included. Default: emulated for real by the same plan cut at the
   governor's final step; its warmup-stable-decay schedule (`lr_at`) cools down over the last
   20% of it, i.e. from the governor's decision step (within a step of rounding, reported as
   `cooldown_start_offset_steps`), as the governor's own cooldown would. `--live` instead runs
   the plan with the governor inside `executor.train.run` (needs the train.py integration,
   `run(..., governor=...)`). `--quick` and `--no-confirm` skip this run: the loss given up is
   then read off the baseline's curve at the decision step, which lacks the cooldown's loss
   drop (the baseline has its own), so it overstates what a governed run gives up on a flat
   curve; the summary then says so.

Figures: compute_saved_frac = 1 - (the governed run's steps, cooldown included) / budget;
loss_given_up = (governed final held-out loss - baseline final held-out loss) / baseline's;
stop_step_rel_err = |predicted - actual decision step| / actual, predicted from the fit after
the first 20% of the budget (also after 30% in the CSV, unless the governor has decided by
then; null when too few evaluations exist by then for a fit). compute_saved_frac_incl_evals
also charges the governed run for its held-out evaluations (every `eval_every` steps, each
costing `eval_cost_steps` training steps, measured) against the 10 an ungoverned run makes. A
threshold sweep is replayed.

The threshold comes from economics (`costmodels.governor.threshold_from_value`): a step costs 1
step of compute, one nat of held-out loss is worth `value_steps_per_nat(max_steps)` steps (the
issue's targets read as a price: 30% of the budget for 1% of a 6-nat loss), so a step is worth
taking while it lowers the loss by at least 1 / value nats.

Writes DIR/governor.csv (one row per scenario and threshold), DIR/governor.json (summary of the
headline threshold; `fresh_*` keys for the control) and DIR/governor.png (held-out loss, the
governor's fit at its decision with its band, budget, predicted and actual stop, final losses).
Runs go to DIR/runs/ (`--reuse` takes finished runs whose plans match from there).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import inspect
import json
import math
import platform
import shutil
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from costmodels.governor import threshold_from_value
from executor.data import load_corpus
from executor.governor import Governor, curve_frame, plot_governor
from executor.train import lr_at, run
from planner.api import plan_for_choice

SHAPE = dict(seq_len=128, micro_batch=8, vocab_size=8192)
SCENARIOS = {
    # the headline: a 41k-token subset (40 steps an epoch) repeated 10 times; the held-out loss
    # bottoms out near step 150 and then rises (overfitting): most of the budget is wasted
    "repeated": dict(max_steps=400, data_fraction=0.03, eval_every=5),
    # the control: fresh data all the way (a tenth of an epoch); the loss still falls fast at the
    # end, so the governor should run the budget out (full mode only)
    "fresh": dict(max_steps=150, data_fraction=1.0, eval_every=5),
}
QUICK = {"repeated": dict(max_steps=200, data_fraction=0.015, eval_every=5)}
TARGETS = dict(compute_saved_frac=0.30, loss_given_up=0.01, stop_step_rel_err=0.15)
REFERENCE_LOSS_NATS = 6.0
"""Order of the held-out loss these runs reach (nats/token), to price the targets."""
SWEEP = (0.5, 1.0, 2.0, 5.0, 10.0)
"""Multiples of the headline value of a nat replayed for the sweep."""
PREDICT_AT = (0.2, 0.3)
"""The stop step is predicted from the fit after these fractions of the budget; the first is
the headline figure."""
GOVERNOR = dict(refit_every=10, min_points=8, confidence=0.9)
REUSED: list[str] = []
"""Runs taken from an earlier invocation (`--reuse`), named in the summary."""
RUN_WALL_S: list[float] = []
"""Training wall time of every run the figures use, reused ones included."""
DEFAULT_EVALS = 10
"""Held-out evaluations an ungoverned run makes (`executor.train.run`'s default: every
max_steps // 10 steps): the baseline of `compute_saved_frac_incl_evals`, which charges the
governed run for its frequent evaluations."""


def make_plan(cfg: dict, threshold: float = 0.0):
    plan = plan_for_choice("tiny-llama", "cpu", **SHAPE, max_steps=cfg["max_steps"],
                           data_fraction=cfg["data_fraction"])
    return with_decisions(plan, governor_threshold=threshold)


def with_decisions(plan, **changes):
    d = dataclasses.replace(plan.decisions, **changes)
    d = dataclasses.replace(d, max_tokens=d.max_steps * d.micro_batch * d.seq_len * d.dp_degree)
    return dataclasses.replace(plan, decisions=d)


def run_plan(plan, data, out: Path, eval_every: int, **extra):
    """`executor.train.run` with the arguments this benchmark relies on (plan, data, out,
    progress, eval_every when it exists)."""
    kw = dict(data=data, out=out, progress=False)
    if "eval_every" in inspect.signature(run).parameters:
        kw["eval_every"] = eval_every
    shutil.rmtree(out, ignore_errors=True)
    return run(plan, **kw, **extra)


def reused(plan, run_dir: Path):
    """The finished run's record in `run_dir` when it ran the same decisions, else None."""
    from executor.record import RunRecord
    from planner.plan import Plan

    try:
        old, rec = Plan.from_json(run_dir / "plan.json"), RunRecord.from_json(run_dir / "record.json")
    except Exception:  # noqa: BLE001 -- anything unreadable means: run it again
        return None
    same = old.decisions == plan.decisions and rec.stop_reason == "budget"
    return rec if same else None


def value_steps_per_nat(max_steps: int) -> float:
    """The headline price of a nat of held-out loss, in steps: the issue's targets read as a
    price, 30% of the budget for 1% of a REFERENCE_LOSS_NATS loss (400 steps: 2,000 steps per
    nat, a threshold of 5e-4 nats/step)."""
    return TARGETS["compute_saved_frac"] * max_steps / (TARGETS["loss_given_up"] * REFERENCE_LOSS_NATS)


def eval_cost_steps(record) -> float:
    """Cost of one held-out evaluation in median training steps, measured on `record`: the wall
    time outside the timed steps (the two untimed measurement steps counted as two median
    steps, though they take longer: an overestimate) per evaluation."""
    med = record.median_step_time_s
    rest = record.wall_s - sum(record.step_times_s) - 2 * med
    return max(rest, 0.0) / max(len(record.heldout_loss), 1) / med


def saved_incl_evals(final_step: int, max_steps: int, eval_cost: float, cfg: dict) -> float:
    """1 - (governed steps + its evaluations) / (budget + DEFAULT_EVALS evaluations), in steps."""
    governed = final_step + (final_step // cfg["eval_every"]) * eval_cost
    return 1.0 - governed / (max_steps + DEFAULT_EVALS * eval_cost)


def governor(plan, threshold: float) -> Governor:
    return Governor.for_plan(with_decisions(plan, governor_threshold=threshold), **GOVERNOR)


def predicted_stop(plan, record, threshold: float, frac: float) -> int | None:
    """The stop step the governor's fit predicts after `frac` of the budget (mean curve)."""
    at = int(frac * plan.decisions.max_steps)
    gov = governor(plan, threshold)
    gov.replay(record.train_loss, record.heldout_loss, until=at)
    return gov.summary()["predicted_stop_step"]


def heldout_at(record, steps: int) -> float:
    """Held-out loss of the recorded run at the last evaluation at or before `steps`."""
    rows = [r for r in record.heldout_loss if r[0] <= steps]
    return float(rows[-1][2]) if rows else math.nan


def row_for(plan, record, threshold: float, base_loss: float) -> tuple[dict, Governor, object]:
    """One threshold replayed over the baseline: the case row, the governor, its last decision."""
    gov = governor(plan, threshold)
    dec = gov.replay(record.train_loss, record.heldout_loss)
    n = plan.decisions.max_steps
    actual = dec.cooldown_start if dec.reason == "marginal_gain" else dec.steps
    at_decision = heldout_at(record, actual)
    row = {"threshold_nats_per_step": threshold, "value_steps_per_nat": 1.0 / threshold,
           "max_steps": n, "reason": dec.reason, "stop_step_decided": actual,
           "final_step": dec.final_step}
    for i, frac in enumerate(PREDICT_AT):
        # no prediction once the governor has already decided: that would be hindsight
        p = predicted_stop(plan, record, threshold, frac) if frac * n < actual else None
        key = "" if i == 0 else f"_at_{int(frac * 100)}pct"
        row[f"stop_step_predicted{key}"] = p if p is not None else math.nan
        row[f"stop_step_rel_err{key}"] = abs(p - actual) / actual if p is not None else math.nan
    row.update({"compute_saved_frac": 1.0 - dec.final_step / n,
                "baseline_final_loss": base_loss, "heldout_loss_at_decision": at_decision,
                "loss_given_up_replay": (at_decision - base_loss) / base_loss,
                "stopped_by": _stopped_by(dec, threshold),
                "fit_E": dec.fit.E if dec.fit else math.nan,
                "fit_alpha": dec.fit.alpha if dec.fit else math.nan})
    return row, gov, dec


def _stopped_by(dec, threshold: float) -> str:
    """Which upper bound fell below the threshold: `power_law`, `trend`, both, or ''."""
    if dec.reason != "marginal_gain":
        return ""
    pairs = zip(("power_law", "trend"), (dec.gain_per_step, dec.trend_per_step))
    return "+".join(n for n, g in pairs if g is not None and g[2] < threshold)


def figure(plan, record, gov: Governor, head: dict, path: Path) -> None:
    """The held-out curve of the baseline, the governor's fit at its decision and band, the
    budget, the predicted and actual stops and both runs' final losses."""
    from matplotlib.figure import Figure

    n = plan.decisions.max_steps
    predicted = head["stop_step_predicted"]
    summary = gov.summary() | {"predicted_stop_step": None if math.isnan(predicted) else int(predicted)}
    finals = {"budget run out": (n, head["baseline_final_loss"])}
    if head["cooldown_measured"]:
        finals = {"governed run, after its cooldown": (head["final_step"], head["governed_final_loss"]),
                  **finals}
    fig = Figure(figsize=(8, 6.5))
    ax = fig.add_subplot()
    plot_governor(ax, curve_frame(record.heldout_loss, summary, max_steps=n), summary, max_steps=n,
                  final_losses=finals)
    pred = "the budget" if summary["predicted_stop_step"] in (None, n) else f"step {int(predicted)}"
    ax.set_title(f"governor: tiny-llama, {n}-step budget, threshold "
                 f"{summary['threshold_nats_per_step']:.2g} nats/step\nstop decided at step "
                 f"{head['stop_step_decided']}, predicted after {PREDICT_AT[0]:.0%} of the budget: "
                 f"{pred}", fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller run, about two minutes")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--live", action="store_true",
                    help="run the governed plan with the governor inside executor.train.run")
    ap.add_argument("--no-confirm", action="store_true",
                    help="skip the real run of the governed plan (replay only)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: small GEMMs under contention are much slower with more)")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse the finished runs in DIR/runs/ whose plans are the same (replay again)")
    ap.add_argument("--steps", type=int, help="override the step budget (exploration only)")
    ap.add_argument("--data-fraction", type=float, help="override the data fraction (exploration only)")
    a = ap.parse_args(argv)
    scenarios = {k: dict(v) for k, v in (QUICK if a.quick else SCENARIOS).items()}
    if a.steps:
        scenarios["repeated"]["max_steps"] = a.steps
    if a.data_fraction:
        scenarios["repeated"]["data_fraction"] = a.data_fraction
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(a.threads)
    t_start = time.perf_counter()
    data = load_corpus(vocab_size=SHAPE["vocab_size"])
    rows, heads = [], {}
    for name, cfg in scenarios.items():
        scenario_rows, head = scenario(name, cfg, data, out, a, headline=name == "repeated")
        if head is None:
            return 2
        rows += scenario_rows
        heads[name] = head
    pd.DataFrame(rows).to_csv(out / "governor.csv", index=False)

    head = heads["repeated"]
    summary = {
        "compute_saved_frac": head["compute_saved_frac"],
        "loss_given_up": head["loss_given_up"],
        "stop_step_rel_err": head["stop_step_rel_err"],
        "targets_met": bool(head["compute_saved_frac"] >= TARGETS["compute_saved_frac"]
                            and head["loss_given_up"] <= TARGETS["loss_given_up"]
                            and head["stop_step_rel_err"] <= TARGETS["stop_step_rel_err"]),
        "compute_saved_frac_incl_evals": head["compute_saved_frac_incl_evals"],
        "eval_cost_steps": head["eval_cost_steps"],
        **{k: head[k] for k in ("governed_run", "cooldown_measured", "loss_given_up_replay",
                                "cooldown_start_offset_steps", "reason", "stopped_by",
                                "stop_step_decided", "final_step", "stop_step_predicted")},
        **{k: head[k] for k in head if k.startswith("stop_step_rel_err_at")},
        **{k: head[k] for k in ("baseline_final_loss", "governed_final_loss",
                                "threshold_nats_per_step", "value_steps_per_nat", "max_steps",
                                "data_fraction", "eval_every")},
    }
    if "fresh" in heads:
        fresh = heads["fresh"]
        summary |= {"fresh_compute_saved_frac": fresh["compute_saved_frac"],
                    "fresh_reason": fresh["reason"], "fresh_final_step": fresh["final_step"],
                    "fresh_max_steps": fresh["max_steps"]}
    summary |= {
        "wall_s": time.perf_counter() - t_start,
        "runs_wall_s": sum(RUN_WALL_S),
        "reused_runs": ", ".join(REUSED),
        "quick": a.quick,
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                   f"{torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if not head["cooldown_measured"]:
        summary["note"] = ("loss_given_up is read off the baseline's curve at the decision step: "
                           "it does not include the cooldown's loss drop (nor the baseline's "
                           "planned cooldown at the same point), so it is not what a live governed "
                           "run gives up; run without --quick/--no-confirm to measure it")
    summary = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in summary.items()}
    (out / "governor.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


def scenario(name: str, cfg: dict, data, out: Path, a, *, headline: bool):
    """Baseline, replayed sweep and (headline, unless --quick/--no-confirm) the governed run
    for one scenario; returns its CSV rows and its headline row (None: --live cannot run)."""
    plan = make_plan(cfg)
    n = plan.decisions.max_steps
    value = value_steps_per_nat(n)
    threshold = threshold_from_value(value_per_nat=value, cost_per_step=1.0)

    # 1. the baseline runs its budget out
    base_dir = out / "runs" / f"governor-{name}-baseline"
    base = reused(plan, base_dir) if a.reuse else None
    if base is None:
        base = run_plan(plan, data, base_dir, cfg["eval_every"])
    else:
        REUSED.append(base_dir.name)
    RUN_WALL_S.append(base.wall_s)
    base_loss = base.final_heldout_loss
    print(f"{name}: baseline {base.steps} steps, final held-out loss {base_loss:.4f}, "
          f"{base.wall_s:.0f} s", flush=True)

    # 2. the governor replayed over it, for the headline threshold and a sweep
    rows, e = [], eval_cost_steps(base)
    for mult in SWEEP:
        thr = threshold_from_value(value_per_nat=value * mult, cost_per_step=1.0)
        row, g, d = row_for(plan, base, thr, base_loss)
        rows.append({"scenario": name, "data_fraction": cfg["data_fraction"],
                     "eval_every": cfg["eval_every"], "headline": mult == 1.0, **row,
                     "eval_cost_steps": e,
                     "compute_saved_frac_incl_evals": saved_incl_evals(d.final_step, n, e, cfg)})
        if mult == 1.0:
            head, gov, dec = rows[-1], g, d
    print(f"{name}: governor (replay, {threshold:.2g} nats/step) {dec.reason} decided at "
          f"{head['stop_step_decided']}, final step {dec.final_step}; predicted after "
          f"{PREDICT_AT[0]:.0%} of the budget: {head['stop_step_predicted']}", flush=True)

    # 3. the governed run, cooldown included
    measured, mode, offset = math.nan, "replay (no cooldown)", None
    if headline and a.live:
        if "governor" not in inspect.signature(run).parameters:
            print("--live: executor.train.run does not take a governor yet", file=sys.stderr)
            return rows, None
        gplan = with_decisions(plan, governor_threshold=threshold)
        rec = run_plan(gplan, data, out / "runs" / f"governor-{name}-live", cfg["eval_every"],
                       governor=Governor.for_plan(gplan, **GOVERNOR))
        RUN_WALL_S.append(rec.wall_s)
        measured, mode = rec.final_heldout_loss, "live"
        head["final_step"] = rec.steps
        head["compute_saved_frac"] = 1.0 - rec.steps / n
        head["compute_saved_frac_incl_evals"] = saved_incl_evals(rec.steps, n, e, cfg)
    elif headline and not a.quick and not a.no_confirm and dec.reason == "marginal_gain":
        cut = with_decisions(plan, max_steps=dec.final_step)
        offset = next(s for s in range(cut.decisions.warmup_steps, dec.final_step)
                      if lr_at(s, cut) < cut.decisions.lr) - dec.cooldown_start
        confirm_dir = out / "runs" / f"governor-{name}-confirm"
        rec = reused(cut, confirm_dir) if a.reuse else None
        if rec is None:
            rec = run_plan(cut, data, confirm_dir, dec.final_step)
        else:
            REUSED.append(confirm_dir.name)
        RUN_WALL_S.append(rec.wall_s)
        measured, mode = rec.final_heldout_loss, "emulated (plan cut at the final step, WSD cooldown)"
        print(f"{name}: governed run (emulated) {rec.steps} steps, final held-out loss "
              f"{measured:.4f}", flush=True)
    head["governed_run"] = mode
    head["cooldown_start_offset_steps"] = offset
    head["cooldown_measured"] = not math.isnan(measured)
    head["governed_final_loss"] = measured if head["cooldown_measured"] else head["heldout_loss_at_decision"]
    head["loss_given_up"] = (head["governed_final_loss"] - base_loss) / base_loss
    head["baseline_wall_s"] = base.wall_s
    if headline:
        figure(plan, base, gov, head, out / "governor.png")
    return rows, head


if __name__ == "__main__":
    sys.exit(main())
