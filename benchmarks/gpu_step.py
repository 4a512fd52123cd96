"""The overlapped step time and memory of a 2-block tiny-llama under FSDP2 (ZeRO-3) on this
machine's accelerator, predicted for a hardware profile (default h200) beside measured, and the
profile refit from the run (`trainplan calibrate`'s GPU method, `trainplan.executor.calibrate.gpu`).

    python benchmarks/gpu_step.py [--hw h200] [--device cuda] [--seq-len 1024] [--micro-batch 8]
                                  [--steps 12] [--quick | --smoke] [--out DIR]

One process: FSDP2's `fully_shard` on each block and the root over a one-rank device mesh (NCCL
on CUDA/ROCm, gloo on a CPU), so the all-gathers, reduce-scatters and their streams run as in a
sharded run, each moving one rank's bytes (a single GPU cannot hold two NCCL ranks). The model
is tiny-llama's architecture cut to 2 blocks; the data are random token ids (no corpus). Steps
as `trainplan.executor.train.run` measures them (`trainplan.executor.measure.measured_step`): on an accelerator the
allocator's peaks per timed step (`torch.accelerator.max_memory_allocated`/`max_memory_reserved`)
and the kernel time split over steps 4 and 5 (`trainplan.executor.kernels`); on a CPU MemTracker and wall
time only (the dry run of `benchmarks/gpu_check.sh`).

Writes DIR/gpu_step.csv (term, unit, predicted, measured, rel_err, and `after`: predicted with
the refit profile), DIR/gpu_step.json (a flat summary), DIR/gpu_step-run/ (plan.json,
record.json) and, when the kernel split was measured, DIR/<hw>-calibrated.toml.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

BLOCKS = 2
VOCAB = 8192


def _device(name: str | None) -> torch.device:
    if name:
        return torch.device(name)
    here = torch.accelerator.current_accelerator(check_available=True)
    return torch.device(here.type if here is not None else "cpu")


def _model(device):
    """tiny-llama's architecture with BLOCKS blocks, on `device` (meta: for the capture)."""
    import transformers

    from trainplan.modeling.presets import get_preset, hf_config

    cfg = hf_config(get_preset("tiny-llama"), vocab_size=VOCAB)
    cfg.num_hidden_layers = BLOCKS
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg)
    model.config.use_cache = False
    return model


def _init_one_rank(dev: torch.device) -> None:
    backend = dist.Backend.default_device_backend_map.get(dev.type, "gloo")
    if dev.type != "cpu":
        torch.accelerator.set_device_index(dev.index or 0)
        backend = f"cpu:gloo,{dev.type}:{backend}"
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)


def _shard(model, dev: torch.device):
    """FSDP2 (ZeRO-3: resharded after forward) on each block and the root, as
    `trainplan.executor.parallel.zero.apply_zero` does above one rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(dev.type, (1,))
    for module in [*model.model.layers, model]:
        fully_shard(module, mesh=mesh, reshard_after_forward=True)
    return model


def run(args) -> dict:
    from trainplan.costmodels.step.model import Choice
    from trainplan.executor.calibrate.gpu import GpuObservation, fit_gpu_profile
    from trainplan.executor.calibrate.gpu_parts import PartsPredictor
    from trainplan.executor.measure import device_name, measured_step, record_device_memory
    from trainplan.executor.optimizers import build_optimizer
    from trainplan.executor.record import RunRecord, same_hardware
    from trainplan.executor.reporting.compare import compare
    from trainplan.hardware_profiles import load
    from trainplan.hardware_profiles.profile_file import write_profile_file
    from trainplan.modeling.loss import lm_loss
    from trainplan.planner.api import plan_for_choice
    from trainplan.planner.capture.setup import capture_model

    dev = _device(args.device)
    hw = load(args.hw)
    out = Path(args.out)
    run_dir = out / "gpu_step-run"
    run_dir.mkdir(parents=True, exist_ok=True)
    meta = _model("meta")
    plan = plan_for_choice(meta, hw, seq_len=args.seq_len, micro_batch=args.micro_batch, devices=1, zero_stage=3,
                           max_steps=args.steps, vocab_size=VOCAB)
    d = plan.decisions
    plan.to_json(run_dir / "plan.json")
    graph, _, numels = capture_model(meta, d.precision, vocab_size=VOCAB)
    predictor = PartsPredictor(graph, numels, Choice.from_decisions(d))

    _init_one_rank(dev)
    model = _shard(_model("cpu").to(dev), dev)
    opt = build_optimizer(model.parameters(), bits=d.optimizer_bits, lr=d.lr, precision=d.precision)
    autocast = partial(torch.autocast, dev.type, dtype=torch.bfloat16, enabled=d.precision == "bf16-mixed")
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (d.micro_batch, d.seq_len + 1), generator=gen) for _ in range(4)]

    def train_step(step: int) -> float:
        tokens = batches[step % len(batches)].to(dev)
        with autocast():
            loss = lm_loss(model(input_ids=tokens[:, :-1]).logits, tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    rec = RunRecord(model=plan.model, hw_planned=plan.hw, device=device_name(dev),
                    same_hardware=same_hardware(plan.hw, device_name(dev)))
    t0 = time.perf_counter()
    for step in range(d.max_steps):
        rec.train_loss.append((step, measured_step(step, train_step, rec, dev, model, opt)))
        rec.steps = step + 1
    rec.wall_s = time.perf_counter() - t0
    rec.tokens = rec.steps * d.micro_batch * d.seq_len
    rec.stop_reason = "budget"
    record_device_memory(rec, dev)
    rec.per_rank_peak_bytes = [rec.peak_memory_bytes.get("total", 0.0)]
    rec.to_json(run_dir / "record.json")
    dist.destroy_process_group()

    before = predictor.parts(hw, memory=True)
    fit, profile_path = None, None
    if rec.kernel_time_s:
        fit = fit_gpu_profile(hw, [GpuObservation(run_dir=str(run_dir), predictor=predictor, record=rec)])
        profile_path = write_profile_file(fit.profile, out / f"{hw.name}-calibrated.toml",
                                          header=f"{hw.name} refit by benchmarks/gpu_step.py from {run_dir}")
    after = fit.rows[0].after if fit else None
    kernels = rec.kernel_time_s or {}
    accel = dev.type != "cpu"
    rows = [(r.term, r.unit, r.predicted, r.measured, math.nan) for r in compare(plan, rec).itertuples()
            if r.term in ("peak_memory", "flops_per_step")]
    rows += [
        ("step_time_overlapped", "s", before.step_s, rec.median_step_time_s, after.step_s if after else math.nan),
        ("max_memory_allocated", "bytes", plan.predictions.memory_bytes["total"],
         rec.max_allocated_bytes if accel else math.nan, after.peak_bytes if after else math.nan),
        ("max_memory_reserved", "bytes", math.nan, rec.max_reserved_bytes if accel else math.nan, math.nan),
        ("kernel_matmul", "s", before.matmul_s, kernels.get("matmul", math.nan), after.matmul_s if after else math.nan),
        ("kernel_other", "s", before.other_s, kernels.get("other", math.nan), after.other_s if after else math.nan),
        ("kernel_communication", "s", before.comm_s, kernels.get("communication", math.nan),
         after.comm_s if after else math.nan),
        ("kernel_busy", "s", math.nan, kernels.get("busy", math.nan), math.nan),
        ("kernel_profiled_wall", "s", math.nan, kernels.get("wall", math.nan), math.nan),
    ]
    import pandas as pd

    df = pd.DataFrame(rows, columns=["term", "unit", "predicted", "measured", "after"])
    df["rel_err"] = [(p - m) / m if m and math.isfinite(m) and math.isfinite(p) else math.nan
                     for p, m in zip(df["predicted"], df["measured"], strict=True)]
    df.to_csv(out / "gpu_step.csv", index=False)
    summary = {
        "date": time.strftime("%Y-%m-%d"), "host": platform.node(), "device": rec.device, "hw": hw.name,
        "same_hardware": rec.same_hardware, "torch": torch.__version__, "blocks": BLOCKS,
        "seq_len": d.seq_len, "micro_batch": d.micro_batch, "precision": d.precision, "zero_stage": d.zero_stage,
        "steps": rec.steps, "timed_steps": len(rec.step_times_s), "kernel_time_s": rec.kernel_time_s,
        "quick": args.quick, "smoke": args.smoke,
        "device_memory_bytes": rec.device_memory_bytes, "profile_out": str(profile_path) if profile_path else None,
        "refit": {"compute": fit.compute, "memory": fit.memory, "network": fit.network,
                  "fields": list(fit.fields), "notes": list(fit.notes)} if fit else None,
        **{f"{r.term}_{k}": getattr(r, k) for r in df.itertuples() for k in ("predicted", "measured", "rel_err")},
    }
    (out / "gpu_step.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")
    return summary


def bounded_plan(path: str, steps: int, largest_micro_batch: int) -> None:
    """Re-plan the plan in `path` (from `trainplan solve --json`) with the same knobs, at most
    `steps` steps and a micro-batch of at most `largest_micro_batch` (0: as solved), every
    prediction made again (`trainplan.planner.api.plan_for_choice`); written back to `path`. For
    benchmarks/gpu_check.sh: a solved plan, run for a bounded time."""
    from trainplan.planner.api import plan_for_choice
    from trainplan.planner.plan import Plan

    plan = Plan.from_json(path)
    d = plan.decisions
    plan_for_choice(plan.model, plan.hw, seq_len=d.seq_len, micro_batch=min(d.micro_batch, largest_micro_batch or
                                                                              d.micro_batch),
                    grad_accum=d.grad_accum, activation_checkpoint=d.activation_checkpoint,
                    checkpoint_sets=d.checkpoint_sets,
                    sp_degree=d.sp_degree, devices=d.devices, zero_stage=d.zero_stage,
                    optimizer_bits=d.optimizer_bits, activation_bits=d.activation_bits, precision=d.precision,
                    max_steps=min(d.max_steps, steps), vocab_size=plan.vocab_size, lr=d.lr,
                    seed=d.seed).to_json(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bounded-plan", nargs=3, metavar=("PLAN", "STEPS", "LARGEST_MICRO_BATCH"),
                    help="only re-plan PLAN at most STEPS steps and micro-batch LARGEST_MICRO_BATCH (0: as "
                         "solved), in place (`bounded_plan`), and exit")
    ap.add_argument("--hw", default="h200", help="profile the step is predicted for (a name or a .toml file)")
    ap.add_argument("--device", help="where to run (default: this machine's accelerator, else cpu)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12, help="at least 7: steps 4 and 5 are profiled, not timed")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true",
                    help="--seq-len 256 --micro-batch 2 --steps 8 (gpu_check's dry run)")
    ap.add_argument("--smoke", action="store_true",
                    help="--seq-len 128 --micro-batch 2 --steps 7 (the test suite's run)")
    a = ap.parse_args(argv)
    if a.quick or a.smoke:
        a.seq_len, a.micro_batch, a.steps = (128, 2, 7) if a.smoke else (256, 2, 8)
    if a.bounded_plan:
        bounded_plan(a.bounded_plan[0], int(a.bounded_plan[1]), int(a.bounded_plan[2]))
        return 0
    if a.steps < 7:
        ap.error(f"--steps must be at least 7, got {a.steps}")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    summary = run(a)
    print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, dict)}, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
