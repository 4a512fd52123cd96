"""Automatic local calibration: short pilot runs on this machine fit the plan's loss law.

`solve(..., data=corpus)` (and `trainplan solve`/`demo`, which always pass the corpus) on the
local `cpu` profile calls `calibrate`: when the pilots of `trainplan.costmodels.loss.pilots.design_pilots`
cost at most 10% of the budget, it trains them for real (`trainplan.executor.train.run`, trainplan's own
loop, with the plan's sequence, learning rate and schedule), fits the local law
(`trainplan.costmodels.loss.pilots.fit_pilot_law`) and charges what they cost to the budget before the
solve. The fit is cached (`<cache root>/laws/pilots-<key>.json`, key: the model's name and shape,
the corpus and tokenizer fingerprint, the sequence, the learning rate and the pilot design) with
the pilots' curves, and reused by any later plan whose budget is at most the one it was sized for
(its pilots were at most 10% of that): such a plan is charged nothing and says so.

The one module of `planner` besides `trainplan.planner.cli` that imports the executor (the import
contract in pyproject.toml names it): calibrating means running.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from torch import nn

from trainplan.costmodels.loss.cache import law_fields, law_from_fields
from trainplan.costmodels.loss.law import LossLaw
from trainplan.costmodels.loss.pilots import (
    MIN_PILOT_STEPS,
    PILOT_BUDGET_FRAC,
    PilotResult,
    PilotSpec,
    design_pilots,
    fit_pilot_law,
)
from trainplan.costmodels.step.model import Choice
from trainplan.costmodels.step.precision import optimizer_bits_for
from trainplan.errors import TrainplanError
from trainplan.hardware_profiles.cache import cache_root
from trainplan.planner.budget import Budget
from trainplan.planner.joint.problem import Problem, make_plan
from trainplan.planner.plan import Plan, SolverFacts

log = logging.getLogger(__name__)

PILOT_DESIGN = "pilots-v4"
"""Version of the pilot design and fit; a cached fit of another version is not reused."""
PILOT_SEED_OFFSET = 1000
"""Pilot i trains with the plan's seed plus this plus i: their own initialisations and batch
orders (independent noise), none the plan's."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Calibration:
    """What `calibrate` decided: the law, the budget left for the plan, and its record."""

    law: LossLaw
    budget: Budget
    record: dict[str, Any]


def pilot_key(pr: Problem, corpus, lr: float) -> str:
    """The cache key of a pilot fit: sha256 over the model's name and shape, the corpus and
    tokenizer fingerprint (`TokenCorpus.sha256`), the sequence, the learning rate and
    `PILOT_DESIGN` (first 16 hex digits)."""
    g = pr.graph
    facts = {"model": pr.name, "n_params": g.n_params, "n_layers": g.n_layers, "hidden": g.hidden_size,
             "vocab": g.vocab_size, "corpus": getattr(corpus, "sha256", ""), "seq_len": pr.seq_len,
             "lr": lr, "precision": pr.precision, "design": PILOT_DESIGN}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def pilot_path(key: str, cache_dir: str | Path | None = None) -> Path:
    """`<cache root>/laws/pilots-<key>.json`."""
    return cache_root(cache_dir) / "laws" / f"pilots-{key}.json"


def _budget_value(budget: Budget) -> tuple[str, float]:
    kind = budget.kind
    return kind, float(getattr(budget, kind))


def _step_cost(pr: Problem, choice: Choice, kind: str) -> float:
    """One optimizer step of `choice` in the budget's unit: FLOPs, seconds or device-hours."""
    cost = pr.step_model.evaluate(choice)
    return {"flops": cost.flops, "wall_clock_s": cost.time_s, "device_hours": cost.time_s / 3600.0}[kind]


def _choice(pr: Problem, micro_batch: int) -> Choice:
    return Choice(sp_degree=1, zero_stage=0, micro_batch=micro_batch, seq_len=pr.seq_len,
                  policies=("none",) * pr.graph.n_layers, precision=pr.precision,
                  optimizer_bits=optimizer_bits_for(pr.precision)[0], devices=1, activation_bits=32)


def _charge(budget: Budget, spent: float) -> Budget:
    kind, value = _budget_value(budget)
    return Budget(devices=budget.devices, **{kind: value - spent})


def _pilot_plan(pr: Problem, spec: PilotSpec, lr: float, seed: int) -> Plan:
    facts = SolverFacts(status="FIXED", objective=0.0, bound=0.0, wall_s=0.0, seed=seed, time_limit_s=0.0)
    plan = make_plan(pr.step_model, pr.profile, pr.graph, pr.name, _choice(pr, spec.micro_batch),
                     budget={"devices": 1, "fixed_steps": spec.steps}, data_fraction=1.0, max_steps=spec.steps,
                     predicted_loss=0.0, unique=pr.unique, law=pr.law, lr=lr, seed=seed, facts=facts,
                     memory_limit_bytes=None)
    return dataclasses.replace(plan, decisions=dataclasses.replace(plan.decisions, warmup_steps=spec.warmup_steps))


def _run_pilots(pr: Problem, model: nn.Module | str, specs: list[PilotSpec], corpus, lr: float, seed: int,
                progress: bool) -> list[PilotResult]:
    from trainplan.executor.train import run  # torch training: only when pilots run

    out = []
    with tempfile.TemporaryDirectory(prefix="trainplan-pilots-") as tmp:
        for i, spec in enumerate(specs):
            plan = _pilot_plan(pr, spec, lr, seed + PILOT_SEED_OFFSET + i)
            config = getattr(model, "trainplan_config", None) if isinstance(model, nn.Module) else None
            if isinstance(config, dict):  # a config-built model: the run rebuilds it from the plan
                plan = dataclasses.replace(plan, hf_config=config)
            on_meta = isinstance(model, nn.Module) and any(p.is_meta for p in model.parameters())
            module = copy.deepcopy(model) if isinstance(model, nn.Module) and not on_meta else None
            log.info("pilot %s: micro-batch %d, %d steps", spec.name, spec.micro_batch, spec.steps)
            t0 = time.perf_counter()
            rec = run(plan, module, corpus, out=Path(tmp) / spec.name, progress=progress,
                      eval_every=spec.eval_every, checkpoint_every=0, eval_tokens=spec.eval_tokens,
                      eval_from=spec.eval_from)
            if rec.stop_reason != "budget":
                raise TrainplanError(f"pilot {spec.name} stopped early ({rec.stop_reason}); nothing was "
                                     "fitted: rerun, or pass calibrate=False")
            h = rec.heldout_loss
            out.append(PilotResult(spec=spec, steps=tuple(s for s, _, _ in h), losses=tuple(v for _, _, v in h),
                                   final_loss=rec.final_heldout_loss, wall_s=time.perf_counter() - t0))
    return out


def calibrate(pr: Problem, model: nn.Module | str, budget: Budget, corpus, *, lr: float, seed: int,
              bytes_per_token: float | None = None, cache_dir: str | Path | None = None,
              progress: bool = False) -> Calibration | None:
    """The local law for `pr` from pilot runs on `corpus`, or None when the rule does not allow
    them (the caller, `calibrated`, then keeps the published law and records why).

    Reuses a cached fit whose budget covers this one (nothing charged); else designs the pilots
    for `budget` (`trainplan.costmodels.loss.pilots.design_pilots`), runs them, fits, caches and returns
    the budget minus what they cost (FLOPs, seconds or device-hours, as the budget is given:
    the cost model's FLOPs per step, the measured seconds).

    Raises:
        TrainplanError: a pilot stopped before its end, or the fit failed.
    """
    kind, value = _budget_value(budget)
    key = pilot_key(pr, corpus, lr)
    path = pilot_path(key, cache_dir)
    cached = _read(path)
    if cached is not None and cached.get("budget_kind") == kind and value <= cached["budget"] * (1 + 1e-9):
        law = dataclasses.replace(law_from_fields(cached["law"]), vocab_size=pr.law.vocab_size)
        record = {k: v for k, v in cached.items() if k not in ("law",)} | {
            "ran": False, "charged": 0.0, "cache": str(path),
            "why": f"reused the pilot fit cached for a budget of {cached['budget']:.3g} {kind} "
                   f"(its pilots were charged to the plan that ran them)"}
        return Calibration(law=law, budget=budget, record=record)
    specs = design_pilots(value, cost_per_step={mb: _step_cost(pr, _choice(pr, mb), kind)
                                                for mb in pr.options["micro_batches"]},
                          seq_len=pr.seq_len)
    if specs is None:
        log.info("no pilots: 10%% of the budget does not buy each pilot enough steps")
        return None
    results = _run_pilots(pr, model, specs, corpus, lr, seed, progress)
    floor = pr.law.E + pr.law.A / float(pr.graph.law_n_params) ** pr.law.alpha  # the published law's, per byte
    law, fit = fit_pilot_law(results, floor_nats=floor, vocab_size=pr.law.vocab_size,
                             bytes_per_token=bytes_per_token)
    spent_flops = sum(s.flops(_step_cost(pr, _choice(pr, s.micro_batch), "flops")) for s in specs)
    spent_s = sum(r.wall_s for r in results)
    spent = {"flops": spent_flops, "wall_clock_s": spent_s, "device_hours": spent_s / 3600.0}[kind]
    if spent >= value:  # a time budget on a machine far slower than its cpu profile says
        raise TrainplanError(f"the pilots took {spent:.3g} of the {value:.3g} {kind} budget (designed for "
                             f"{PILOT_BUDGET_FRAC:.0%} of it: the cpu profile's step times are off; "
                             "`trainplan calibrate` refits them); give a FLOP budget or pass calibrate=False")
    record = {"format": 1, "key": key, "design": PILOT_DESIGN, "budget_kind": kind, "budget": value,
              "pilot_flops": spent_flops, "pilot_s": spent_s, "pilot_budget_frac": spent / value,
              "pilots": [dataclasses.asdict(r.spec) | {"steps_done": list(r.steps), "losses": list(r.losses),
                                                       "final_loss": r.final_loss, "wall_s": r.wall_s}
                         for r in results],
              "fit": fit, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    _write(path, record | {"law": law_fields(law)})
    return Calibration(law=law, budget=_charge(budget, spent),
                       record=record | {"ran": True, "charged": spent, "cache": str(path),
                                        "why": f"{len(specs)} pilots run, {spent / value:.1%} of the budget, "
                                               "charged to it"})


def calibrated(pr: Problem, model: nn.Module | str, budget: Budget, data, *, enabled: bool, lr: float, seed: int,
               bytes_per_token: float | None = None, cache_dir=None,
               progress: bool = False) -> tuple[Problem, Budget, dict | None]:
    """(problem, budget, record) after the automatic local calibration (`trainplan.planner.pilots.calibrate`):
    the problem with the pilots' law and the budget less what they cost, when `enabled`, `data`
    is given and the profile is the local `cpu` one (pilots run on this machine); else as given,
    with a record saying why not (None when no corpus was given)."""
    if not enabled or data is None:
        return pr, budget, None
    if pr.profile.name != "cpu":
        return pr, budget, {"ran": False, "why": f"pilots run on this machine, not on {pr.profile.name}: "
                                                 f"the law is {pr.law.source}"}
    if (isinstance(model, nn.Module) and not isinstance(getattr(model, "trainplan_config", None), dict)
            and any(p.is_meta for p in model.parameters())):
        return pr, budget, {"ran": False, "why": "the model is on the meta device: pilots train a copy of "
                                                 f"its weights; the law is {pr.law.source}"}
    cal = calibrate(pr, model, budget, data, lr=lr, seed=seed, bytes_per_token=bytes_per_token,
                    cache_dir=cache_dir, progress=progress)
    if cal is None:
        return pr, budget, {"ran": False, "why": "10% of the budget does not buy the pilots "
                                                 f"{MIN_PILOT_STEPS} steps each: the law is {pr.law.source}"}
    return dataclasses.replace(pr, law=cal.law), cal.budget, cal.record


def _read(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("design") != PILOT_DESIGN or "law" not in record:
        return None
    return record


def _write(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)


def with_calibration(plan: Plan, record: dict[str, Any] | None) -> Plan:
    """`plan` with `Predictions.loss_calibration` set to `record` (the pilots' curves left out:
    they are in the cache file the record names)."""
    if not record:
        return plan
    slim = {k: v for k, v in record.items() if k not in ("pilots", "fit")}
    slim["pilots"] = [{k: p[k] for k in ("name", "micro_batch", "steps", "cost", "final_loss", "wall_s")}
                      for p in record.get("pilots", [])]
    slim["fit"] = {k: v for k, v in record.get("fit", {}).items() if k != "points"}
    return dataclasses.replace(plan, predictions=dataclasses.replace(plan.predictions, loss_calibration=slim))
