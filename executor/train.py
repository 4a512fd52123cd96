"""Apply a Plan to a real torch training run and measure it.

One process per rank. The plan's checkpoint menu entries become `torch.utils.checkpoint`
selective checkpointing per block, its optimizer bits an optimizer (bitsandbytes for 8 bits),
its data fraction and token budget the sampler and the step count; `sp_degree`/`zero_stage`
above one device go through `executor.parallel` under torchrun. Measured: peak tensor memory by
category (MemTracker, one step after warm-up), FLOPs of one step (FlopCounterMode), every
step's wall time, train loss, held-out loss.
"""

from __future__ import annotations

import math
import signal
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import torch
from torch import nn

from costmodels.remat import POLICIES, is_checkpointed, op_is_saved
from executor.data import TokenBatches, TokenCorpus, heldout_batches, load_corpus
from executor.record import RunRecord
from hardware_profiles import load as load_profile
from hardware_profiles.errors import PlanMismatchError, TrainingDivergedError, TrainplanError
from planner.capture import CPU_ATTENTION_FLOP_FORMULAS, lm_loss
from planner.plan import Plan

WARMUP_STEPS_UNMEASURED = 2  # optimizer states exist from step 1 on; measure after that
EVAL_BATCHES = 4


def resolve_device(plan: Plan, override: str | None = None) -> torch.device:
    """The device a plan runs on: `override`, else the plan's profile's device type.

    Raises:
        TrainplanError: the plan targets an accelerator and none is present.
    """
    if override:
        return torch.device(override)
    kind = load_profile(plan.hw).device_type
    if kind == "cuda" and not torch.cuda.is_available():
        raise TrainplanError(
            f"plan targets {plan.hw!r} (a CUDA/ROCm device) but torch sees none here; "
            "run it with --device cpu to execute it on the CPU (times are then not compared)")
    return torch.device(kind)


def build_optimizer(params, bits: int, lr: float) -> torch.optim.Optimizer:
    """AdamW with 32-bit states (torch) or 8-bit block-wise states (bitsandbytes AdamW8bit,
    Dettmers et al. 2022).

    Raises:
        TrainplanError: bits not in (32, 8).
    """
    if bits == 32:
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    if bits == 8:
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    raise TrainplanError(f"optimizer_bits={bits} cannot run here: use 32 or 8")


def _sac_forward(orig, policy: str, *args, **kwargs):
    from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                        create_selective_checkpoint_contexts)

    def policy_fn(ctx, op, *a, **kw):
        return CheckpointPolicy.MUST_SAVE if op_is_saved(policy, str(op)) else CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = partial(create_selective_checkpoint_contexts, policy_fn)
    return checkpoint(orig, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def apply_checkpointing(model: nn.Module, policies: tuple[str, ...]) -> None:
    """Wrap each transformer layer's forward in the checkpoint its policy names (parameter
    names are unchanged).

    Raises:
        PlanMismatchError: the model has a different number of layers than the plan.
    """
    layers = model.model.layers
    if len(layers) != len(policies):
        raise PlanMismatchError(f"plan has checkpoint choices for {len(policies)} layers, "
                                f"the model has {len(layers)}")
    for layer, policy in zip(layers, policies):
        if is_checkpointed(policy):
            layer.forward = partial(_sac_forward, layer.forward, policy)


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


def _measure_memory(step_fn, model, opt) -> dict[str, float]:
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(model, opt)
    with mt:
        step_fn()
    snap = next(iter(mt.get_tracker_snapshot("peak").values()))
    by = {str(k).split(".")[-1]: float(v) for k, v in snap.items()}
    return {"params": by.get("PARAM", 0.0) + by.get("BUFFER", 0.0), "grads": by.get("GRAD", 0.0),
            "optimizer": by.get("OPT", 0.0), "activations": by.get("ACT", 0.0),
            "temporaries": by.get("TEMP", 0.0) + by.get("OTH", 0.0) + by.get("INP", 0.0),
            "total": by.get("Total", 0.0)}


@torch.no_grad()
def heldout_loss(model: nn.Module, batches, forward_loss) -> float:
    """Mean cross-entropy (nats/token) over fixed held-out batches (same on every rank)."""
    was = model.training
    model.eval()
    losses = [forward_loss(x, y).item() for x, y in batches]
    model.train(was)
    return sum(losses) / len(losses)


def _forward_loss(model, dev, sp: int, sp_rank: int, world: int, x, y) -> torch.Tensor:
    """Loss of one micro-batch: x, y (b, s) token ids and next-token targets. Under Ulysses SP
    each rank feeds its contiguous sequence shard with global positions; `sp_loss` makes the
    averaged gradients equal the single-process ones."""
    if world == 1:
        return lm_loss(model(input_ids=x.to(dev)).logits, y.to(dev))
    from executor.parallel import sp_loss

    sl = x.shape[1] // sp
    lo, hi = sp_rank * sl, (sp_rank + 1) * sl
    pos = torch.arange(lo, hi, device=dev).unsqueeze(0).expand(x.shape[0], -1)
    logits = model(input_ids=x[:, lo:hi].to(dev), position_ids=pos, use_cache=False).logits
    return sp_loss(logits, y[:, lo:hi].to(dev), None, None)


def _init_world(plan: Plan, dev: torch.device) -> tuple[int, int]:
    import os

    d = plan.decisions
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    if world_env != d.devices:
        raise TrainplanError(
            f"plan uses {d.devices} device(s) but this process group has {world_env}: "
            "use `trainplan run PLAN --out DIR`, which launches torchrun with the plan's count")
    if world_env == 1:
        return 0, 1
    from executor.launch import init_distributed

    return init_distributed(dev)


def _gather_floats(value: float, world: int) -> list[float]:
    if world == 1:
        return [value]
    import torch.distributed as dist

    out: list = [None] * world
    dist.all_gather_object(out, value)
    return [float(v) for v in out]


def run(plan: Plan, model: nn.Module | None = None, data: TokenCorpus | None = None, *,
        out: str | Path, device: str | None = None, progress: bool = True,
        eval_every: int | None = None) -> RunRecord:
    """Run `plan` for real on one process; returns and writes `out/record.json`.

    The record is rewritten at every evaluation, so an interrupted run (SIGINT/SIGTERM) keeps
    what it measured; its `stop_reason` says why it ended: `budget`, `interrupted` or `nan`.

    Raises:
        PlanMismatchError: model or corpus do not match the plan.
        TrainingDivergedError: the loss became NaN or infinite (the record is written first).
    """
    from planner.presets import build_model

    d = plan.decisions
    dev = resolve_device(plan, device)
    rank, world = _init_world(plan, dev)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = data or load_corpus(vocab_size=plan.vocab_size)
    if model is None:
        dtype = torch.float32 if d.precision == "fp32" else torch.bfloat16
        model = build_model(plan.model, device=dev, dtype=dtype, vocab_size=data.vocab_size, seed=d.seed)
    n_params = sum(p.numel() for p in model.parameters())
    if n_params != plan.model_n_params:
        raise PlanMismatchError(f"plan was made for {plan.model} with {plan.model_n_params:,} "
                                f"parameters; this model has {n_params:,}")
    apply_checkpointing(model, d.checkpoint)
    model.train()
    factory = partial(build_optimizer, bits=d.optimizer_bits, lr=d.lr)
    if world > 1:
        from executor.parallel import apply_zero, enable_ulysses, new_sequence_parallel_group

        new_sequence_parallel_group(d.sp_degree)
        enable_ulysses(model, seq_len=d.seq_len)
        model, opt = apply_zero(model, factory, stage=d.zero_stage, device=dev)
    else:
        opt = factory(model.parameters())
    dp_rank, sp_rank = rank // d.sp_degree, rank % d.sp_degree
    batches = TokenBatches(data.train_tokens, seq_len=d.seq_len, micro_batch=d.micro_batch,
                           fraction=d.data_fraction, seed=d.seed, rank=dp_rank, world_size=d.dp_degree)
    held = heldout_batches(data.heldout_tokens, seq_len=d.seq_len, micro_batch=d.micro_batch,
                           max_batches=EVAL_BATCHES)
    forward_loss = partial(_forward_loss, model, dev, d.sp_degree, sp_rank, world)
    eval_every = eval_every or max(1, d.max_steps // 10)
    rec = RunRecord(model=plan.model, hw_planned=plan.hw, device=_device_name(dev),
                    same_hardware=(plan.hw == "cpu" and dev.type == "cpu"))
    autocast = (torch.autocast(dev.type, dtype=torch.bfloat16) if d.precision == "bf16-mixed"
                else nullcontext())

    def train_step(step: int) -> float:
        x, y = batches.batch(step)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, plan)
        with autocast:
            loss = forward_loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    stop = {"reason": ""}

    def on_signal(signum, frame):
        stop["reason"] = "interrupted"

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    t_start = time.perf_counter()
    bar = _progress(d.max_steps, progress)
    try:
        for step in range(d.max_steps):
            if stop["reason"]:
                break
            if step == WARMUP_STEPS_UNMEASURED and dev.type == "cpu":
                losses = []
                rec.peak_memory_bytes = _measure_memory(lambda: losses.append(train_step(step)), model, opt)
                loss = losses[0]
            elif step == WARMUP_STEPS_UNMEASURED + 1:
                from torch.utils.flop_counter import FlopCounterMode

                fc = FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOP_FORMULAS)
                with fc:
                    loss = train_step(step)
                rec.flops_per_step = float(fc.get_total_flops())
            else:
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                loss = train_step(step)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                rec.step_times_s.append(time.perf_counter() - t0)
            rec.steps = step + 1
            rec.tokens = rec.steps * d.micro_batch * d.seq_len * d.dp_degree
            rec.train_loss.append((step, loss))
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
            if not math.isfinite(loss):
                stop["reason"] = "nan"
                break
            if (step + 1) % eval_every == 0 or step + 1 == d.max_steps:
                rec.heldout_loss.append((step + 1, rec.tokens, heldout_loss(model, held, forward_loss)))
                rec.wall_s = time.perf_counter() - t_start
                if rank == 0:
                    rec.to_json(out / "record.json")
        if dev.type == "cuda":
            rec.peak_memory_bytes = {"total": float(torch.cuda.max_memory_allocated(dev))}
            rec.notes.append(f"reserved {torch.cuda.max_memory_reserved(dev)} bytes")
    finally:
        bar.close()
        for s, h in old.items():
            signal.signal(s, h)
        rec.stop_reason = stop["reason"] or "budget"
        rec.wall_s = time.perf_counter() - t_start
        rec.world_size = world
        rec.per_rank_peak_bytes = _gather_floats(rec.peak_memory_bytes.get("total", 0.0), world)
        if rank == 0:
            rec.to_json(out / "record.json")
    if rec.stop_reason == "nan":
        raise TrainingDivergedError(f"loss became {rec.train_loss[-1][1]} at step {rec.steps - 1}; "
                                    f"record kept in {out / 'record.json'}; lower the learning rate "
                                    f"(plan lr={d.lr})")
    return rec


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"{dev} ({torch.cuda.get_device_name(dev)})"
    return str(dev)


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, desc="train", unit="step", leave=False)
