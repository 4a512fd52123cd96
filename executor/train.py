"""Apply a Plan to a real torch training run and measure it.

One process per rank. The plan's checkpoint menu entries become `torch.utils.checkpoint`
selective checkpointing per block, its optimizer bits an optimizer (bitsandbytes for 8 bits),
its data fraction, method and token budget the sampler
(`executor.data.dynamic_selection.PlannedBatches`) and the step count; `sp_degree`/`zero_stage`
above one device go through `executor.parallel.ulysses` and `executor.parallel.zero` under torchrun.
An optimizer step runs `grad_accum` micro-steps (`executor.accumulation`), each on the next micro-batch.
Measured: peak tensor memory by category (MemTracker, one step after warm-up), FLOPs of one step
(FlopCounterMode), every step's wall time, train loss, held-out loss, the data selection's scoring
FLOPs. Interrupts, checkpoints and resuming:
`executor.checkpoint`; the measurement helpers: `executor.measure`.

`executor.parallel.ulysses` and `executor.parallel.zero` are imported in the functions that use
them, by multi-device runs only: they load transformers' attention interface and FSDP2's
internals (seconds), which torch builds without distributed support do not have.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from costmodels.checkpoint_sets import CheckpointSet, KeyCounter, resolve, sets_from_mapping
from costmodels.stopping.rule import Governor
from executor.accumulation import accumulate_gradients
from executor.checkpoint import (
    OutOfMemoryRunError,
    check_resume_plan,
    is_out_of_memory,
    latest_checkpoint,
    load_checkpoint,
    out_of_memory_message,
    remove_checkpoints,
    save_checkpoint,
)
from executor.data.batches import TokenCorpus, check_corpus_for_plan, heldout_batches, load_corpus
from executor.data.dynamic_selection import PlannedBatches
from executor.fit_check import check_fits as check_plan_fits
from executor.governor import GovernedLoop
from executor.measure import any_rank, device_name, gather_floats, heldout_loss, measured_step, progress_bar
from executor.optimizers import build_optimizer, set_lr
from executor.parallel.launch import init_distributed
from executor.record import RunRecord, same_hardware
from executor.reporting.trackers import TrackerSpec, open_trackers
from hardware_profiles import load as load_profile
from hardware_profiles.threads import threads_per_rank
from modeling import presets
from modeling.activation_compression import compress_saved_activations
from modeling.loss import lm_loss
from planner.plan import Plan
from trainplan_errors import PlanMismatchError, TrainingDivergedError, TrainplanError, UnknownNameError

EVAL_BATCHES = 4
"""Held-out micro-batches of each evaluation (`executor.data.batches.heldout_batches`)."""


def resolve_device(plan: Plan, override: str | None = None) -> torch.device:
    """The device a plan runs on: `override`, else the plan's profile's device type (for a profile
    read from a file, `--hw FILE.toml`, which `load` does not know by name: the accelerator here).

    Raises:
        TrainplanError: the plan targets an accelerator and none is present.
    """
    if override:
        return torch.device(override)
    if plan.hw == "cpu":  # no need to load (and maybe measure) the cpu profile in every rank
        return torch.device("cpu")
    try:
        kind = load_profile(plan.hw).device_type
    except UnknownNameError:
        kind = getattr(torch.accelerator.current_accelerator(check_available=True), "type", "cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        raise TrainplanError(
            f"plan targets {plan.hw!r} (a CUDA/ROCm device) but torch sees none here; "
            "run it with --device cpu to execute it on the CPU (times are then not compared)")
    return torch.device(kind)


def sac_forward(orig, entry: CheckpointSet, *args, **kwargs):
    """Run `orig` under torch's selective activation checkpointing with `entry`'s saved set.

    The policy function names each op call of this forward by its node key (`KeyCounter`: the
    overload and its call count, as `costmodels.checkpoint_sets.node_keys` names the captured forward's
    nodes) and answers MUST_SAVE for the keys `entry` keeps, MUST_RECOMPUTE otherwise (views
    and other ops that make no storage are never kept). torch calls the policy in the forward
    only and replays by call index, so a fresh counter per forward is the whole state."""

    def context_fn():
        counter = KeyCounter()

        def policy_fn(ctx, op, *a, **kw):
            if entry.saves(counter.key(str(op))):
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.MUST_RECOMPUTE

        return create_selective_checkpoint_contexts(policy_fn)

    return checkpoint(orig, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def apply_checkpointing(model: nn.Module, policies: tuple[str, ...],
                        sets: dict[str, list[str]] | None = None) -> None:
    """Wrap each transformer layer's forward in the checkpoint its entry names (parameter
    names are unchanged). `sets`: the plan's `Decisions.checkpoint_sets`, the saved node keys of
    each solved entry (`remat:k`) that `policies` names.

    Raises:
        PlanMismatchError: the model has a different number of layers than the plan, or the
            plan names an entry it does not define.
    """
    layers = cast(nn.ModuleList, model.get_submodule("model.layers"))  # a transformers causal LM's blocks
    if len(layers) != len(policies):
        raise PlanMismatchError(f"plan has checkpoint choices for {len(policies)} layers, "
                                f"the model has {len(layers)}")
    known = sets_from_mapping(sets)
    for layer, policy in zip(layers, policies, strict=False):
        try:
            entry = resolve(policy, known)
        except TrainplanError as e:
            raise PlanMismatchError(str(e)) from None
        if entry.checkpointed:
            layer.forward = partial(sac_forward, layer.forward, entry)


def lr_at(step: int, plan: Plan) -> float:
    """Warmup-stable-decay: linear warmup, constant, linear cooldown over the last 20% of the
    planned steps (Hu et al. 2024, MiniCPM; lets a run stop at any budget with a cooldown)."""
    d = plan.decisions
    peak = d.lr
    if step < d.warmup_steps:
        return peak * (step + 1) / d.warmup_steps
    cool = max(1, int(0.2 * d.max_steps))
    start = d.max_steps - cool
    return peak if step < start else peak * max(0.05, (d.max_steps - step) / cool)


def micro_batch_loss(model, dev, sp: int, sp_rank: int, world: int, x, y) -> torch.Tensor:
    """Loss of one micro-batch (nats/token, a scalar): x, y (b, s) token ids and next-token
    targets, `model` on device `dev`. Under Ulysses SP (`sp` ranks per sequence, this one
    `sp_rank`, `world` ranks in all) each rank feeds its contiguous sequence shard with global
    positions; `executor.parallel.ulysses.sp_loss` makes the averaged gradients equal the
    single-process ones."""
    if world == 1:
        return lm_loss(model(input_ids=x.to(dev)).logits, y.to(dev))
    from executor.parallel.ulysses import sp_loss  # multi-device only: see the module docstring

    sl = x.shape[1] // sp
    lo, hi = sp_rank * sl, (sp_rank + 1) * sl
    pos = torch.arange(lo, hi, device=dev).unsqueeze(0).expand(x.shape[0], -1)
    logits = model(input_ids=x[:, lo:hi].to(dev), position_ids=pos, use_cache=False).logits
    return sp_loss(logits, y[:, lo:hi].to(dev), None, None)


def _init_world(plan: Plan, dev: torch.device) -> tuple[int, int]:
    d = plan.decisions
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    if world_env != d.devices:
        raise TrainplanError(
            f"plan uses {d.devices} device(s) but this process group has {world_env}: "
            "use `trainplan run PLAN --out DIR`, which launches torchrun with the plan's count")
    if world_env == 1:
        return 0, 1
    return init_distributed(dev)


def _build(plan: Plan, model: nn.Module | None, data: TokenCorpus, dev: torch.device, world: int):
    """The model (built from the preset when None), checkpointed per the plan and sharded per
    its ZeRO stage, and its optimizer."""
    d = plan.decisions
    if model is None:
        dtype = torch.bfloat16 if d.precision == "bf16" else torch.float32  # bf16-mixed: autocast
        model = presets.build_model(plan.model, device=dev, dtype=dtype, vocab_size=data.vocab_size, seed=d.seed)
    n_params = sum(p.numel() for p in model.parameters())
    if n_params != plan.model_n_params:
        raise PlanMismatchError(f"plan was made for {plan.model} with {plan.model_n_params:,} "
                                f"parameters; this model has {n_params:,}")
    apply_checkpointing(model, d.checkpoint, d.checkpoint_sets)
    model.train()
    factory = partial(build_optimizer, bits=d.optimizer_bits, lr=d.lr, precision=d.precision)
    if world == 1:
        return model, factory(model.parameters())
    from executor.parallel.ulysses import enable_ulysses, new_sequence_parallel_group  # see the module docstring
    from executor.parallel.zero import apply_zero, mixed_precision_policy

    new_sequence_parallel_group(d.sp_degree)
    enable_ulysses(model, seq_len=d.seq_len)
    return apply_zero(model, factory, stage=d.zero_stage, device=dev, mp_policy=mixed_precision_policy(d))


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
        trackers: TrackerSpec | None = None, threads: int | None = None) -> RunRecord:
    """Run `plan` for real on one process; returns and writes `out/record.json`.

    The record is rewritten at every evaluation and when the run ends, however it ends; its
    `stop_reason` says why: `budget`, `interrupted` (SIGINT/SIGTERM, acted on at the next step
    boundary), `nan`, `out_of_memory` or `error`. A checkpoint (`executor.checkpoint`) is written
    at the end, on an interrupt and every `checkpoint_every` steps.

    checkpoint_every: also checkpoint every this many steps; None: only at the end and on an
        interrupt; 0: never.
    resume: continue the run in `out` from its latest checkpoint: model, optimizer, RNG states
        and record restored, steps from the next one on with the same batches
        (`TokenBatches.batch(step)`) and learning rates, the record appended to. Without it a
        run in a used `out` starts over and deletes the old checkpoints.
    stop_after_steps: for tests: act as if SIGINT arrived once this many steps are done in all.
    governor: the compute governor (`executor.governor`); None: `Governor.for_plan(plan)` when
        the plan's `governor_threshold` is > 0, else none. A governed run can also stop with
        `marginal_gain` (after the cooldown its decision starts; final checkpoint and record as
        at a budget stop) or `diverged`; it evaluates every max_steps // 50 steps by default.
    check_fits: first check that the plan's processes and predicted memory fit this machine
        (`executor.fit_check.check_fits`); False skips it.
    threads: torch's intra-op threads in the steps (restored after); None: OMP_NUM_THREADS if set,
        else the usable cores // ranks (`hardware_profiles.threads`, as the cpu profile is measured).
    trackers: TensorBoard, wandb, trackio: rank 0 reports to them (`executor.reporting.trackers`).

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
    rank, world = _init_world(plan, dev)
    threads, threads_before = threads_per_rank(world, threads), torch.get_num_threads()
    if check_fits:
        check_plan_fits(plan, dev, in_worker=world > 1)
    if trackers is not None:
        trackers.check()  # a tracker not installed: before the model is built and the data scored
    out.mkdir(parents=True, exist_ok=True)
    data = data or load_corpus(vocab_size=plan.vocab_size)
    check_corpus_for_plan(data, seq_len=d.seq_len, vocab_size=plan.vocab_size)  # before building
    model, opt = _build(plan, model, data, dev, world)
    dp_rank, sp_rank = rank // d.sp_degree, rank % d.sp_degree
    held = heldout_batches(data.heldout_tokens, seq_len=d.seq_len, micro_batch=d.micro_batch,
                           max_batches=EVAL_BATCHES)
    forward_loss = partial(micro_batch_loss, model, dev, d.sp_degree, sp_rank, world)
    eval_every = eval_every or GovernedLoop.default_eval_every(plan, governor)
    corpus = {"name": data.name, "sha256": data.sha256}
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
                             record=rec, progress=progress)  # the data subset: executor.data.dynamic_selection
    gov = GovernedLoop.for_run(plan, governor, record=rec if resume else None, out=out, rank=rank,
                               world=world)
    from executor.parallel.zero import mixed_precision_policy  # torch.distributed: see _build

    autocast = (torch.autocast(dev.type, dtype=torch.bfloat16)
                if d.precision == "bf16-mixed" and mixed_precision_policy(d) is None
                else nullcontext())

    ga = d.grad_accum

    def train_step(step: int) -> float:  # `ga` micro-steps on micro-batches step x ga + j; mean loss
        set_lr(opt, lr_at(step, plan) * gov.lr(step))

        def forward(j: int) -> torch.Tensor:
            x, y = batches.batch(step * ga + j)
            with autocast, compress_saved_activations(d.activation_bits):
                return forward_loss(x, y)

        loss = accumulate_gradients(forward, grad_accum=ga, model=model, zero_stage=d.zero_stage, world=world)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    tracker = open_trackers(trackers, plan, rec, out=out, rank=rank)  # rank 0's; closed in the finally below
    stop = {"reason": gov.ended, "by": ""}  # a resumed run the governor had ended: nothing to run
    old = _catch_signals(stop)
    t_start, wall_before = time.perf_counter(), rec.wall_s
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
            if rec.steps % eval_every == 0 or rec.steps == d.max_steps or gov.eval_due(rec.steps):
                rec.heldout_loss.append((rec.steps, rec.tokens, heldout_loss(model, held, forward_loss)))
                rec.wall_s = wall_before + time.perf_counter() - t_start
                if rank == 0:
                    rec.to_json(out / "record.json")
            tracker.log(rec)  # this step's scalars, flushed
            if gov.on and (reason := gov.after_step(rec)):
                if reason == "marginal_gain" and (not rec.heldout_loss or rec.heldout_loss[-1][0] != rec.steps):
                    # ended at once (no cooldown) between evaluations: the final loss at the stop
                    rec.heldout_loss.append((rec.steps, rec.tokens, heldout_loss(model, held, forward_loss)))
                stop["reason"] = reason
                break
            if checkpoint_every and rec.steps % checkpoint_every == 0 and rec.steps < d.max_steps:
                save_checkpoint(model=model, opt=opt, record=rec, **ckpt)
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
