"""Each long-context knob run for real on this CPU: predicted peak memory and FLOPs beside
MemTracker and FlopCounterMode, and the losses beside the same plan without the knob.

    python benchmarks/long_context.py [--quick | --smoke] [--out DIR] [--hw cpu --device cpu]

Model: `tiny-llama` (4 layers, hidden 256, fp32, 32-bit AdamW) with the default corpus's
8192-token BPE, so the loss head (8192 logits per token, 32 x the width) weighs as it does at
scale. Micro-batch 2, 256 tokens, 4 steps per plan (`trainplan.executor.train.run`: MemTracker on a step
after two warm-up steps, FlopCounterMode), one torch thread. Plans (`trainplan.planner.api.plan_for_choice`):

- `none`, `full`: every block unchecked / fully checkpointed, nothing tiled (the references);
- `none+loss8`: the LM head and loss over 8 sequence chunks (`trainplan.modeling.tiling.tiled_lm_loss`);
- `none+mlp4`: every block's MLP over 4 chunks (`trainplan.modeling.tiling.tile_mlp`);
- `full+loss8+mlp4`: both, blocks fully checkpointed;
- `full+offload`: checkpointed blocks' inputs to host memory (`trainplan.modeling.offload`); on a CPU the
  device is the host, so this measures the mechanism's cost, not a saving.

With `--hw h200 --device cuda` (`benchmarks/gpu_check.sh`, step 6) the plans are made for that
profile at fp32 (so bytes compare exactly) and run on the accelerator, the peak measured as
`max_memory_allocated`: there offload moves the inputs to pinned host memory, and
`offload_saving_bytes_predicted` / `_measured` (`full` less `full+offload`) check it.

--quick runs `none`, `none+loss8` and `full+loss8+mlp4`. Summary keys: `peak_rel_err_max` and
`flops_rel_err_max` over the tiled plans, `loss_rel_diff_max` (each plan's train losses against
its reference's, `none` or `full`), `tiled_loss_peak_saving_frac` (`none+loss8` against `none`,
measured). Writes DIR/long_context.csv and DIR/long_context.json, prints the summary last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

MODEL, VOCAB, SEQ, MB, STEPS = "tiny-llama", 8192, 256, 2, 4
PLANS = {
    "none": dict(activation_checkpoint="none"),
    "full": dict(activation_checkpoint="full"),
    "none+loss8": dict(activation_checkpoint="none", loss_chunks=8),
    "none+mlp4": dict(activation_checkpoint="none", mlp_chunks=4),
    "full+loss8+mlp4": dict(activation_checkpoint="full", loss_chunks=8, mlp_chunks=4),
    "full+offload": dict(activation_checkpoint="full", offload=True),
}
QUICK = ("none", "none+loss8", "full+loss8+mlp4")
SMOKE = ("none", "none+loss8")
"""`--smoke` (the test suite's run): one tiled plan and its reference, held-out loss on one batch."""


def run_plan(name: str, data, out: Path, hw: str = "cpu", device: str = "cpu", smoke: bool = False) -> dict:
    """Plan `name` (`PLANS`) trained for `STEPS` steps: its predictions beside its measurements."""
    from trainplan.executor.train import run
    from trainplan.planner.api import plan_for_choice

    plan = plan_for_choice(MODEL, hw, seq_len=SEQ, micro_batch=MB, max_steps=STEPS, vocab_size=data.vocab_size,
                           data_tokens=data.n_train_tokens, optimizer_bits=32, precision="fp32", **PLANS[name])
    t0 = time.perf_counter()
    rec = run(plan, data=data, out=out / name, device=device, progress=False, check_fits=False, threads=1,
              **(dict(eval_every=STEPS, eval_tokens=SEQ * MB) if smoke else {}))
    p = plan.predictions
    pred, meas = p.memory_bytes["total"], rec.peak_memory_bytes["total"]
    return dict(plan=name, predicted_peak_bytes=pred, measured_peak_bytes=meas, peak_rel_err=pred / meas - 1,
                phase=p.memory_phase,
                predicted_flops=p.flops_per_step, measured_flops=rec.flops_per_step,
                flops_rel_err=p.flops_per_step / rec.flops_per_step - 1,
                train_losses=json.dumps([round(v, 7) for _, v in rec.train_loss]), run_s=time.perf_counter() - t0)


def summarize(df: pd.DataFrame, quick: bool, hw: str = "cpu", device: str = "cpu", smoke: bool = False) -> dict:
    rows = df.set_index("plan")
    tiled = rows.drop(index=[n for n in ("none", "full") if n in rows.index])
    diffs = []
    for name, r in tiled.iterrows():
        ref = "full" if str(name).startswith("full") else "none"
        if ref in rows.index:
            a, b = json.loads(r["train_losses"]), json.loads(rows.loc[ref, "train_losses"])
            diffs += [abs(x / y - 1) for x, y in zip(a, b, strict=True)]
    saving = (1 - rows.loc["none+loss8", "measured_peak_bytes"] / rows.loc["none", "measured_peak_bytes"]
              if {"none", "none+loss8"} <= set(rows.index) else None)
    offload = {}
    if {"full", "full+offload"} <= set(rows.index):
        offload = {f"offload_saving_bytes_{k}": float(rows.loc["full", f"{k}_peak_bytes"]
                                                      - rows.loc["full+offload", f"{k}_peak_bytes"])
                   for k in ("predicted", "measured")}
    return {"peak_rel_err_max": float(tiled["peak_rel_err"].abs().max()),
            "flops_rel_err_max": float(tiled["flops_rel_err"].abs().max()),
            "loss_rel_diff_max": max(diffs) if diffs else None, "tiled_loss_peak_saving_frac": saving, **offload,
            "targets_met": bool(tiled["peak_rel_err"].abs().max() <= 0.01 and (not diffs or max(diffs) <= 1e-5)),
            "quick": quick, "smoke": smoke, "machine": f"{platform.node()} {platform.machine()}, 1 torch thread",
            "hw": hw, "device": device,
            "torch": torch.__version__, "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"the plans {', '.join(QUICK)}")
    ap.add_argument("--smoke", action="store_true", help=f"the plans {', '.join(SMOKE)} (the test suite's run)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--hw", default="cpu", help="the profile the plans are made for")
    ap.add_argument("--device", default="cpu", help="where they run (cuda on a GPU)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from trainplan.executor.data.batches import load_corpus

    t0 = time.perf_counter()
    data = load_corpus(vocab_size=VOCAB)
    with tempfile.TemporaryDirectory() as runs:  # the runs' folders: only their numbers are kept
        names = SMOKE if a.smoke else QUICK if a.quick else PLANS
        rows = [run_plan(n, data, Path(runs), a.hw, a.device, a.smoke) for n in names]
    df = pd.DataFrame(rows)
    df.to_csv(out / "long_context.csv", index=False)
    summary = summarize(df, a.quick, a.hw, a.device, a.smoke) | {"wall_s": time.perf_counter() - t0}
    (out / "long_context.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(df[["plan", "predicted_peak_bytes", "measured_peak_bytes", "peak_rel_err", "phase",
              "flops_rel_err"]].to_string(index=False))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
