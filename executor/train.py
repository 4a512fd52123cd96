"""Run a Plan for real: trainplan's own training loop over the plan's corpus, measured and
checkpointed.

One process per rank. The model (the preset's, the one the plan's `hf_config` builds, or the
caller's) gets the plan applied by `trainplan.executor.apply.applied.apply_plan`, the function a user's own
loop calls too: checkpoint sets (with the op check), `sp_degree`/`zero_stage` above one device
through `trainplan.executor.parallel.ulysses` and `trainplan.executor.parallel.zero` under torchrun, the optimizer of
its bits. The plan's data fraction, method and token budget become the sampler
(`trainplan.executor.data.dynamic_selection.PlannedBatches`) and the step count. An optimizer step runs
`grad_accum` micro-steps (`trainplan.executor.accumulation`), each on the next micro-batch, at the learning
rate of `trainplan.executor.apply.applied.lr_at` times the governor's. Measured: peak tensor memory by
category (MemTracker, one step after warm-up), FLOPs of one step (FlopCounterMode), every step's
wall time, train loss, held-out loss, the data selection's scoring FLOPs. Interrupts, checkpoints
and resuming: `trainplan.executor.checkpoint`; the measurement helpers: `trainplan.executor.measure`.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainplan.costmodels.stopping.rule import Governor
from trainplan.errors import TrainingDivergedError, TrainplanError
from trainplan.executor.accumulation import accumulate_gradients
from trainplan.executor.apply.applied import apply_plan, init_world, lr_at, resolve_device
from trainplan.executor.checkpoint import (
    OutOfMemoryRunError,
    check_resume_plan,
    is_out_of_memory,
    latest_checkpoint,
    load_checkpoint,
    out_of_memory_message,
    remove_checkpoints,
    save_checkpoint,
)
from trainplan.executor.data.batches import TokenCorpus, check_corpus_for_plan, heldout_batches, load_corpus
from trainplan.executor.data.dynamic_selection import PlannedBatches
from trainplan.executor.fit_check import check_fits as check_plan_fits
from trainplan.executor.governor import GovernedLoop
from trainplan.executor.measure import any_rank, device_name, gather_floats, heldout_loss, measured_step, progress_bar
from trainplan.executor.optimizers import set_lr
from trainplan.executor.record import RunRecord, same_hardware
from trainplan.executor.reporting.forecast import online_forecast
from trainplan.executor.reporting.trackers import TrackerSpec, open_trackers
from trainplan.hardware_profiles.threads import threads_per_rank
from trainplan.modeling import configs, presets
from trainplan.planner.plan import Plan

EVAL_BATCHES = 4
"""Fewest held-out micro-batches of each evaluation (`trainplan.executor.data.batches.heldout_batches`)."""
EVAL_TOKENS = 16384
"""Fewest held-out tokens of each evaluation: at a small micro-batch, more batches, so that plans
of different micro-batches are measured on the same held-out text with the same noise (issue
#23's batch comparison; 4 batches of 1 x 256 tokens scattered by about 0.05 nats)."""


def eval_batches(micro_batch: int, seq_len: int, eval_tokens: int | None = None,
                 heldout_len: int | None = None) -> int:
    """Held-out micro-batches per evaluation: enough for `eval_tokens` (default `EVAL_TOKENS`,
    and at least `EVAL_BATCHES` batches); given `eval_tokens`, exactly enough for them. Given
    `heldout_len` (held-out tokens), the default takes at most half of its windows beyond
    `EVAL_BATCHES` batches: the rest is the DSIR/influence target (`trainplan.executor.data.dynamic_selection`)."""
    per = micro_batch * seq_len
    if eval_tokens is not None:
        return max(1, -(-int(eval_tokens) // per))
    want = max(EVAL_BATCHES, -(-EVAL_TOKENS // per))
    if heldout_len is not None:
        want = min(want, max(EVAL_BATCHES, (heldout_len - 1) // seq_len // (2 * micro_batch)))
    return want


def _catch_signals(stop: dict) -> dict:
    """SIGINT/SIGTERM set `stop["reason"]` (the loop checkpoints at the next step boundary); a
    second SIGINT raises KeyboardInterrupt at once (the record is written, no checkpoint).
    Returns the old handlers ({} off the main thread, where signals cannot be caught)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def on_signal(signum, frame):
        if stop["reason"] and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop["reason"], stop["by"] = "interrupted", signal.Signals(signum).name

    return {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}


def run(plan: Plan, model: nn.Module | None = None, data: TokenCorpus | None = None, *,
        out: str | Path, device: str | None = None, progress: bool = True,
        eval_every: int | None = None, checkpoint_every: int | None = None,
        resume: bool = False, stop_after_steps: int | None = None,
        governor: Governor | None = None, check_fits: bool = True,
        trackers: TrackerSpec | None = None, threads: int | None = None,
        eval_tokens: int | None = None, eval_from: int = 0) -> RunRecord:
    """Run `plan` for real on one process; returns and writes `out/record.json`.

    The record is rewritten at every evaluation and when the run ends, however it ends; its
    `stop_reason` says why: `budget`, `interrupted` (SIGINT/SIGTERM, acted on at the next step
    boundary), `nan`, `out_of_memory` or `error`. A checkpoint (`trainplan.executor.checkpoint`) is written
    at the end, on an interrupt and every `checkpoint_every` steps.

    checkpoint_every: also checkpoint every this many steps; None: only at the end and on an
        interrupt; 0: never.
    resume: continue the run in `out` from its latest checkpoint: model, optimizer, RNG states
        and record restored, steps from the next one on with the same batches
        (`TokenBatches.batch(step)`) and learning rates, the record appended to. Without it a
        run in a used `out` starts over and deletes the old checkpoints.
    stop_after_steps: for tests: act as if SIGINT arrived once this many steps are done in all.
    governor: the compute governor (`trainplan.executor.governor`); None: `Governor.for_plan(plan)` when
        the plan's `governor_threshold` is > 0, else none. A governed run can also stop with
        `marginal_gain` (after the cooldown its decision starts; final checkpoint and record as
        at a budget stop) or `diverged`; it evaluates every max_steps // 50 steps by default.
    check_fits: first check that the plan's processes and predicted memory fit this machine
        (`trainplan.executor.fit_check.check_fits`); False skips it.
    threads: torch's intra-op threads in the steps (restored after); None: OMP_NUM_THREADS if set,
        else the usable cores // ranks (`trainplan.hardware_profiles.threads`, as the cpu profile is measured).
    trackers: TensorBoard, wandb, trackio: rank 0 reports to them (`trainplan.executor.reporting.trackers`).
    eval_tokens: held-out tokens of each evaluation (`eval_batches`); None: at least
        `EVAL_TOKENS` and `EVAL_BATCHES` micro-batches.
    eval_from: no periodic evaluation before this many steps (pilots: their early transient is
        not fitted, `trainplan.costmodels.loss.pilots`); the last step is always evaluated.

    Raises:
        PlanMismatchError: model or corpus do not match the plan; on resume, a plan or corpus
            that differs from the run's. `PlanDoesNotFitError` (a subclass): the plan does not
            fit this machine (with `check_fits`).
        TrainplanError: resume without a checkpoint in `out`.
        OutOfMemoryRunError: a step ran out of memory (the record is written first).
        TrainingDivergedError: the loss became NaN or infinite (the record is written first).
    """
    d = plan.decisions
    if checkpoint_every is not None and (not isinstance(checkpoint_every, int) or checkpoint_every < 0):
        raise TrainplanError(f"checkpoint_every={checkpoint_every!r} must be None or a whole "
                             "number >= 0")
    out = Path(out)
    if resume:
        check_resume_plan(plan, out)
    dev = resolve_device(plan, device)
    rank, world = init_world(plan, dev)
    threads, threads_before = threads_per_rank(world, threads), torch.get_num_threads()
    if check_fits:
        check_plan_fits(plan, dev, in_worker=world > 1)
    if trackers is not None:
        trackers.check()  # a tracker not installed: before the model is built and the data scored
    out.mkdir(parents=True, exist_ok=True)
    data = data or load_corpus(vocab_size=plan.vocab_size)
    check_corpus_for_plan(data, seq_len=d.seq_len, vocab_size=plan.vocab_size)  # before building
    if model is None:
        dtype = torch.bfloat16 if d.precision == "bf16" else torch.float32  # bf16-mixed: autocast
        if plan.hf_config is not None:  # a config-built model (`trainplan solve --model config.json`)
            model = configs.build_from_config(plan.hf_config, device=dev, dtype=dtype, vocab_size=data.vocab_size,
                                              seed=d.seed, name=plan.model)
        else:
            model = presets.build_model(plan.model, device=dev, dtype=dtype, vocab_size=data.vocab_size, seed=d.seed)
    applied = apply_plan(plan, model, device=dev, lr_scheduler=False)  # checkpoint sets, SP, ZeRO, optimizer
    model, opt, dp_rank = applied.model, applied.optimizer, applied.dp_rank
    held = heldout_batches(data.heldout_tokens, seq_len=d.seq_len, micro_batch=d.micro_batch,
                           max_batches=eval_batches(d.micro_batch, d.seq_len, eval_tokens,
                                                    len(data.heldout_tokens)))
    forward_loss = applied.forward_loss
    eval_every = eval_every or GovernedLoop.default_eval_every(plan, governor)
    corpus = {"name": data.name, "sha256": data.sha256, "tokenizer": data.tokenizer_path}
    ckpt: dict[str, Any] = dict(out=out, plan=plan, corpus=corpus, dev=dev, rank=rank, world=world)
    if resume:
        latest = latest_checkpoint(out)
        assert latest is not None  # check_resume_plan above found it
        meta = load_checkpoint(latest, model, opt, corpus=corpus, dev=dev, rank=rank, world=world)
        rec, start = meta["record"], meta["steps"]
        rec.stop_reason, rec.device = "", device_name(dev)
        rec.notes.append(f"resumed at step {start} from {rec.checkpoint}")
    else:
        if rank == 0:
            remove_checkpoints(out)
            plan.to_json(out / "plan.json")
        rec = RunRecord(model=plan.model, hw_planned=plan.hw, device=device_name(dev),
                        same_hardware=same_hardware(plan.hw, device_name(dev)))
        start = 0
    batches = PlannedBatches(plan, data, model=model, rank=dp_rank, held=held, out=out, start=start,
                             # the data subset: trainplan.executor.data.dynamic_selection
                             record=rec, progress=progress)
    gov = GovernedLoop.for_run(plan, governor, record=rec if resume else None, out=out, rank=rank,
                               world=world)
    ga = d.grad_accum

    def train_step(step: int) -> float:  # `ga` micro-steps on micro-batches step x ga + j; mean loss
        set_lr(opt, lr_at(step, plan) * gov.lr(step))

        def forward(j: int) -> torch.Tensor:  # under the plan's autocast and activation compression
            return applied.loss(*batches.batch(step * ga + j))

        loss = accumulate_gradients(forward, grad_accum=ga, model=model, zero_stage=d.zero_stage, world=world)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    wall_budget_s = (plan.budget or {}).get("wall_clock_s")  # checked against wall time as the run goes
    tracker = open_trackers(trackers, plan, rec, out=out, rank=rank)  # rank 0's; closed in the finally below
    stop = {"reason": gov.ended, "by": ""}  # a resumed run the governor had ended: nothing to run
    old = _catch_signals(stop)
    t_start, wall_before = time.perf_counter(), rec.wall_s
    budget_t0 = wall_clock()
    bar = progress_bar(d.max_steps, progress, initial=start)
    step, failure = start, None
    try:
        torch.set_num_threads(threads)
        for step in range(start, gov.end(d.max_steps)):
            if any_rank(bool(stop["reason"]), world):
                stop["reason"] = "interrupted"
                break
            batches.update(step)  # dynamic data selection re-scores here, outside the measured step
            loss = measured_step(step, train_step, rec, dev, model, opt)
            rec.steps = step + 1
            rec.tokens = rec.steps * d.micro_batch * d.seq_len * d.dp_degree * ga
            rec.train_loss.append((step, loss))
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)  # shown by the update
            bar.update(1)
            if stop_after_steps is not None and rec.steps >= stop_after_steps:
                stop["reason"], stop["by"] = "interrupted", f"stop_after_steps={stop_after_steps}"
            if not math.isfinite(loss):
                stop["reason"] = "nan"
                break
            if ((rec.steps % eval_every == 0 and rec.steps >= eval_from) or rec.steps == d.max_steps
                    or gov.eval_due(rec.steps)):
                rec.heldout_loss.append((rec.steps, rec.tokens, heldout_loss(model, held, forward_loss)))
                if (made := online_forecast(plan, rec)) is not None:  # the run as its own pilot
                    rec.loss_forecast.append(made)
                rec.wall_s = wall_before + time.perf_counter() - t_start
                if rank == 0:
                    rec.to_json(out / "record.json")
            tracker.log(rec)  # this step's scalars, flushed
            if gov.on and (reason := gov.after_step(rec)):
                if reason == "marginal_gain":  # ended at once (no cooldown), maybe between evaluations
                    _heldout_at_stop(rec, model, held, forward_loss)
                stop["reason"] = reason
                break
            if checkpoint_every and rec.steps % checkpoint_every == 0 and rec.steps < d.max_steps:
                save_checkpoint(model=model, opt=opt, record=rec, **ckpt)
            if (wall_budget_s is not None and rec.steps < d.max_steps
                    and any_rank(wall_before + wall_clock() - budget_t0 >= wall_budget_s, world)):
                _wall_budget_reached(rec, wall_budget_s, d.max_steps, held, model, forward_loss)
                stop["reason"] = "budget"
                break
    except (Exception, KeyboardInterrupt) as e:  # the record is written, then it is raised again
        failure = e
    finally:
        bar.close()
        torch.set_num_threads(threads_before)
        for s, h in old.items():
            signal.signal(s, h)
        tracker.close(rec)  # never raises: the record is written next
    rec.wall_s = wall_before + time.perf_counter() - t_start
    if failure is None:
        _finish(rec, stop, plan, model, opt, checkpoint_every, ckpt)
    else:
        rec.stop_reason = ("out_of_memory" if is_out_of_memory(failure) else "interrupted"
                           if isinstance(failure, KeyboardInterrupt) else "error")
        rec.notes.append(f"{type(failure).__name__} in step {step}: {str(failure).strip()[:300]}")
    if rank == 0 or failure is not None:
        rec.to_json(out / ("record.json" if rank == 0 else f"record-rank{rank}.json"))
    if failure is not None:
        if is_out_of_memory(failure):
            raise OutOfMemoryRunError(out_of_memory_message(plan, step, dev, failure, out)) from failure
        raise failure
    if rec.stop_reason in ("nan", "diverged"):
        raise TrainingDivergedError(f"loss {rec.stop_reason} (last {rec.train_loss[-1][1]}) at step "
                                    f"{rec.steps - 1}; record kept in {out / 'record.json'}; lower the "
                                    f"learning rate (plan lr={d.lr})")
    return rec


wall_clock = time.perf_counter
"""The clock a wall-clock budget (`Budget.wall_clock_s`) is checked against (tests replace it)."""


def _heldout_at_stop(rec: RunRecord, model, held, forward_loss) -> None:
    """The held-out loss at the step a run stops early, unless that step was just evaluated: the
    final loss is then the stop's."""
    if not rec.heldout_loss or rec.heldout_loss[-1][0] != rec.steps:
        rec.heldout_loss.append((rec.steps, rec.tokens, heldout_loss(model, held, forward_loss)))


def _wall_budget_reached(rec: RunRecord, budget_s: float, max_steps: int, held, model, forward_loss) -> None:
    """A plan budgeted in seconds stops at the first step boundary past its wall-clock budget
    (issue #40, item 15: its steps are planned from predicted step times, and a slower machine
    once ran 28 s of a 15 s budget and called it the budget): the held-out loss at the stop and a
    note of how far the run got. The budget counts the training loop's wall time (`rec.wall_s`,
    evaluations included), not the planning and setup before it."""
    _heldout_at_stop(rec, model, held, forward_loss)
    rec.notes.append(f"wall-clock budget of {budget_s:g} s reached after {rec.steps} of {max_steps} planned "
                     "steps (the steps were planned from predicted step times)")


def _finish(rec: RunRecord, stop: dict, plan: Plan, model, opt, checkpoint_every, ckpt: dict) -> None:
    """After the last step on every rank: stop reason, peak memory of all ranks, the final
    checkpoint (collectives when world > 1)."""
    world = ckpt["world"]
    reason = stop["reason"] or "budget"
    if reason == "interrupted" and rec.steps == plan.decisions.max_steps:
        reason = "budget"  # the signal came during the last step: nothing left to resume
    rec.stop_reason = reason
    if reason == "interrupted":
        rec.notes.append(f"interrupted ({stop['by']}) after {rec.steps} of "
                         f"{plan.decisions.max_steps} steps")
    rec.world_size = world
    rec.per_rank_peak_bytes = gather_floats(rec.peak_memory_bytes.get("total", 0.0), world)
    if reason in ("budget", "interrupted", "marginal_gain") and checkpoint_every != 0:
        save_checkpoint(model=model, opt=opt, record=rec, **ckpt)
