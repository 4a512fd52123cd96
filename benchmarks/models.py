"""Any model a user brings (issue #20): 12 architectures trained tiny on this CPU, planned full-size.

Each architecture of `benchmarks/_model_zoo.py` is trained tiny for real on this CPU (predicted
peak memory and FLOPs beside MemTracker and FlopCounterMode) and planned at its published size
for 8 x h100.

    python benchmarks/models.py [--quick | --smoke] [--out DIR] [--arch NAME ...]

Architectures (`_model_zoo.ARCHS`): Llama 3.1, Mistral (window below the sequence), Qwen2, Qwen3,
Gemma, Gemma 2, Phi-3, OLMo 2, GPT-2, GPT-NeoX (Pythia), Mixtral (MoE) and a nanoGPT-style module
written in `_model_zoo` (a user's own `nn.Module`). For each:

- tiny runs: the tiny config (2 layers, hidden 64, the default corpus's 8192-token BPE, fp32,
  32-bit AdamW) planned for `cpu` with every knob fixed (`trainplan.planner.api.plan_for_choice`) at
  micro-batches 2 and 3 x sequences 64 and 128 (the windowed architectures' windows, 32 and 48,
  are below both), checkpointing `none` and `full`, and trained for `STEPS` steps by
  `trainplan.executor.train.run` on the model (MemTracker on a step after two warm-up steps,
  FlopCounterMode on another; one torch thread);
- SP 2: the `SP_CELL` plan at `sp_degree=2` on 2 processes (torchrun, gloo, one thread each; this
  file is the worker, `--sp-worker`) from the same weights and batches: its losses against the
  1-process run's (`sp_loss_max_rel_diff`) and its per-rank peak against the prediction. Where
  the planner refuses SP 2 for the architecture (`plan_for_choice` says why), the row says
  `not offered: ...` and that is no failure; a plan that is made and then cannot run is one;
- full size: the published config (`Arch.source`) built on the meta device, captured
  (`trainplan.planner.capture.setup.setup_model` for `h100`: `capture_s`) and planned end to end by
  `trainplan.planner.api.solve(model, "h100", Budget(devices=8, device_hours=1000), seq_len=...)`
  (`solve_s`; `solver_s` the CP-SAT part) at 4096 tokens or the model's positions if fewer.

Every cell runs in a try/except: a failure is a row whose `status` is `error: <one line>` and the
run goes on. An architecture passes when all its cells ran, every tiny run's peak is within 1%
and FLOPs within 0.5% of the measurement, its SP run (where offered) trains within 1e-5 of one
process, and its full-size plan captured in under 10 s.

--quick: sequence 128 only, no SP runs, the full-size configs captured but not solved (a solve
takes up to a minute): 1.5 minutes on 2 cores. The full grid: 7 minutes (12 architectures, 96 tiny
runs, 8 SP runs, 12 solves; December 2026, 2 shared cores).

Writes DIR/models.csv (one row per cell: `kind` tiny, sp or full_size), DIR/models_archs.csv
(one row per architecture: its status, worst errors, capture and solve seconds, source) and
DIR/models.json (summary; targets: `architectures` = all of them passing, `peak_memory_max_rel_err`
<= 1%, `flops_max_rel_err` <= 0.5%, `sp_loss_max_rel_diff` <= 1e-5, `capture_s_max_full_size`
< 10 s); prints the per-architecture table and the summary last. The runs use a private trainplan
cache (the cpu profile quick-measured at one thread; the tokenizer and token caches linked from
the user's), so the user's cpu profile is untouched.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _model_zoo, beside this script
from _model_zoo import ARCHS, full_model, tiny_model  # noqa: E402

VOCAB = 8192  # the default corpus's BPE (`trainplan.executor.data.batches.load_corpus`), as the demo trains
STEPS = 4  # 2 warm-up, 1 MemTracker, 1 FlopCounterMode
MICRO_BATCHES = (2, 3)
SEQS = (64, 128)
QUICK_SEQS = (128,)
CHECKPOINTS = ("none", "full")
SMOKE_CELL = (64, 2, "none")
"""`--smoke`'s one tiny cell: sequence, micro-batch, checkpoint."""
SP_CELL = dict(micro_batch=2, seq_len=128)
"""The tiny cell run again at SP 2 (checkpoint none), against its 1-process run."""
FULL_HW, FULL_DEVICES, FULL_DEVICE_HOURS, FULL_SEQ = "h100", 8, 1000.0, 4096
SP_TIMEOUT_S = 300
TARGETS = dict(peak_memory_max_rel_err=0.01, flops_max_rel_err=0.005, sp_loss_max_rel_diff=1e-5,
               capture_s_max_full_size=10.0)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def one_line(e: BaseException) -> str:
    """`Type: first line` of an exception, at most 300 characters; when it has several lines (a
    worker's failure quoting its stderr), the first 150 characters of the first and the last
    line (the worker's own error), at most 300."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = _cut(lines[0], 300) if lines else ""
    if len(lines) > 1 and lines[-1] != lines[0]:
        text = _cut(lines[0], 150) + " | " + _cut(lines[-1], 300)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def tiny(arch: str, vocab: int = VOCAB) -> torch.nn.Module:
    """The tiny model of `arch`, weights from seed 0 (the same in every process)."""
    return tiny_model(arch, vocab, device="cpu", seed=0)


# --- tiny runs ---------------------------------------------------------------------------------

def run_tiny(arch: str, cell: dict, data, out: Path) -> dict:
    """Plan `cell` (micro_batch, seq_len, checkpoint) for the tiny `arch` on `cpu` and train it
    for `STEPS` steps: predicted beside measured peak and FLOPs, and the train losses."""
    from trainplan.executor.train import run
    from trainplan.planner.api import plan_for_choice

    row = dict(arch=arch, kind="tiny", sp_degree=1, devices=1, **cell)
    t0 = time.perf_counter()
    try:
        model = tiny(arch, data.vocab_size)
        plan = plan_for_choice(model, "cpu", **cell, max_steps=STEPS, vocab_size=data.vocab_size,
                               data_tokens=data.n_train_tokens, optimizer_bits=32, precision="fp32")
    except Exception as e:  # capture or planning refused the model
        return row | dict(status=f"error: plan: {one_line(e)}", run_s=time.perf_counter() - t0)
    row["plan_s"] = time.perf_counter() - t0
    try:
        rec = run(plan, model=model, data=data, out=out, device="cpu", progress=False, check_fits=False,
                  threads=1, checkpoint_every=0)
    except Exception as e:
        return row | dict(status=f"error: run: {one_line(e)}", run_s=time.perf_counter() - t0)
    return row | measured(plan, rec.peak_memory_bytes.get("total", 0.0), rec) | dict(
        status="ok", run_s=time.perf_counter() - t0)


def measured(plan, peak: float, rec) -> dict:
    """Predicted beside measured: peak memory per device, FLOPs per step, the train losses."""
    p = plan.predictions
    pred_peak, pred_flops = p.memory_bytes["total"], p.flops_per_step
    return dict(predicted_peak_bytes=pred_peak, measured_peak_bytes=peak,
                peak_rel_err=pred_peak / peak - 1 if peak else float("nan"), phase=p.memory_phase,
                predicted_flops=pred_flops, measured_flops=rec.flops_per_step,
                flops_rel_err=pred_flops / rec.flops_per_step - 1 if rec.flops_per_step else float("nan"),
                steps=rec.steps, stop_reason=rec.stop_reason,
                train_losses=json.dumps([round(v, 7) for _, v in rec.train_loss]))


# --- SP 2 --------------------------------------------------------------------------------------

def run_sp(arch: str, data, out: Path, reference: dict | None) -> dict:
    """`SP_CELL` at SP 2 on 2 processes, against `reference` (its 1-process row)."""
    from trainplan.errors import CaptureError, TrainplanError
    from trainplan.executor.parallel.launch import run_torchrun
    from trainplan.executor.record import RunRecord
    from trainplan.planner.api import plan_for_choice

    row = dict(arch=arch, kind="sp", sp_degree=2, devices=2, activation_checkpoint="none", **SP_CELL)
    t0 = time.perf_counter()
    if reference is None or reference.get("status") != "ok":
        return row | dict(status="skipped: its 1-process run did not run", run_s=0.0)
    try:
        plan = plan_for_choice(tiny(arch, data.vocab_size), "cpu", **SP_CELL, activation_checkpoint="none", sp_degree=2,
                               devices=2, max_steps=STEPS, vocab_size=data.vocab_size,
                               data_tokens=data.n_train_tokens, optimizer_bits=32, precision="fp32")
    except TrainplanError as e:
        if not isinstance(e, CaptureError):  # a refused knob: the planner does not offer SP 2 here, and says why
            return row | dict(status=f"not offered: {one_line(e)}", run_s=time.perf_counter() - t0)
        return row | dict(status=f"error: plan: {one_line(e)}", run_s=time.perf_counter() - t0)
    except Exception as e:
        return row | dict(status=f"error: plan: {one_line(e)}", run_s=time.perf_counter() - t0)
    try:
        out.mkdir(parents=True, exist_ok=True)
        plan.to_json(out / "sp_plan.json")
        run_torchrun("benchmarks.models", ["--sp-worker", arch, str(out / "sp_plan.json"), str(out)], 2,
                     timeout_s=SP_TIMEOUT_S, log_dir=out / "logs", env={"OMP_NUM_THREADS": "1"})
        rec = RunRecord.from_json(out / "record.json")
    except Exception as e:
        return row | dict(status=f"error: run: {one_line(e)}", run_s=time.perf_counter() - t0)
    per_rank = list(rec.per_rank_peak_bytes) or [rec.peak_memory_bytes.get("total", 0.0)]
    row |= measured(plan, max(per_rank), rec) | dict(per_rank_peak_bytes=json.dumps(per_rank))
    ref, mine = json.loads(reference["train_losses"]), json.loads(row["train_losses"])
    if len(ref) != len(mine) or not ref:
        return row | dict(status=f"error: run: {len(mine)} SP losses against {len(ref)} of one process",
                          run_s=time.perf_counter() - t0)
    row["loss_rel_diff"] = max(abs(x - y) / abs(y) for x, y in zip(mine, ref, strict=True))
    return row | dict(status="ok", run_s=time.perf_counter() - t0)


def sp_worker(arch: str, plan_path: str, out: str) -> None:
    """One rank of `run_sp` (under torchrun): the tiny `arch` from seed 0 trained by the plan."""
    from trainplan.executor.data.batches import load_corpus
    from trainplan.executor.train import run
    from trainplan.planner.plan import Plan

    torch.set_num_threads(1)
    plan = Plan.from_json(plan_path)
    data = load_corpus(vocab_size=plan.vocab_size)
    run(plan, model=tiny(arch, data.vocab_size), data=data, out=out, device="cpu", progress=False,
        check_fits=False, threads=1, checkpoint_every=0)


# --- full size ---------------------------------------------------------------------------------

def max_positions(cfg: dict) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "block_size"):
        if isinstance(cfg.get(key), int):
            return cfg[key]
    return None


def run_full(arch: str, solve_it: bool = True) -> dict:
    """The published config on the meta device: capture seconds (`setup_model` for h100) and,
    with `solve_it`, the end-to-end solve for 8 x h100."""
    from trainplan.planner.api import solve
    from trainplan.planner.budget import Budget
    from trainplan.planner.capture.setup import setup_model

    a = ARCHS[arch]
    seq = min(FULL_SEQ, max_positions(a.full) or FULL_SEQ)
    row = dict(arch=arch, kind="full_size", seq_len=seq, devices=FULL_DEVICES, hw=FULL_HW, source=a.source)
    try:
        model = full_model(arch, device="meta")
        row["params"] = sum(p.numel() for p in model.parameters())
        t0 = time.perf_counter()
        graph = setup_model(model, FULL_HW, precision=None, vocab_size=None)[2]
        row["capture_s"] = time.perf_counter() - t0
        row["layers_captured"] = getattr(graph, "n_layers", None)
    except Exception as e:
        return row | dict(status=f"error: capture: {one_line(e)}")
    if not solve_it:
        return row | dict(status="ok")
    try:
        t0 = time.perf_counter()
        plan = solve(model, FULL_HW, Budget(devices=FULL_DEVICES, device_hours=FULL_DEVICE_HOURS), seq_len=seq)
        row["solve_s"] = time.perf_counter() - t0
    except Exception as e:
        return row | dict(status=f"error: solve: {one_line(e)}")
    d, p = plan.decisions, plan.predictions
    ckpt = ", ".join(f"{d.activation_checkpoint.count(c)} x {c}" for c in dict.fromkeys(d.activation_checkpoint))
    return row | dict(status="ok", solver_s=plan.solver.wall_s, solver_status=plan.solver.status,
                      sp_degree=d.sp_degree, zero_stage=d.zero_stage, micro_batch=d.micro_batch,
                      plan_checkpoint=ckpt, optimizer_bits=d.optimizer_bits,
                      predicted_peak_bytes=p.memory_bytes["total"], predicted_step_s=p.step_time_s,
                      warnings=json.dumps(list(getattr(plan, "warnings", []) or [])))


# --- one architecture, the summary -------------------------------------------------------------

def run_arch(arch: str, data, root: Path, quick: bool, smoke: bool = False) -> list[dict]:
    """Every cell of `arch`: tiny runs (skipped once planning the tiny model failed: the capture
    does not depend on the cell), the SP run, the full-size plan. `smoke`: one tiny cell
    (`SMOKE_CELL`), no SP run, the full-size config captured but not solved."""
    rows: list[dict] = []
    failed_plan = None
    quick = quick or smoke
    grid = [SMOKE_CELL] if smoke else [(seq, mb, ck) for seq in (QUICK_SEQS if quick else SEQS)
                                       for mb in MICRO_BATCHES for ck in CHECKPOINTS]
    for seq, mb, ck in grid:
        cell = dict(seq_len=seq, micro_batch=mb, activation_checkpoint=ck)
        if failed_plan:
            rows.append(dict(arch=arch, kind="tiny", sp_degree=1, devices=1, **cell,
                             status=f"skipped: planning failed at {failed_plan}"))
            continue
        r = run_tiny(arch, cell, data, root / arch / f"s{seq}_mb{mb}_{ck}")
        rows.append(r)
        report(r)
        if r["status"].startswith("error: plan"):
            failed_plan = f"s{seq} mb{mb} {ck}"
    if not quick:
        ref = next((r for r in rows if r["kind"] == "tiny" and r["activation_checkpoint"] == "none"
                    and r["micro_batch"] == SP_CELL["micro_batch"] and r["seq_len"] == SP_CELL["seq_len"]), None)
        r = run_sp(arch, data, root / arch / "sp2", ref)
        rows.append(r)
        report(r)
    r = run_full(arch, solve_it=not quick)
    rows.append(r)
    report(r)
    return rows


def report(r: dict) -> None:
    what = {"tiny": "s{seq_len} mb{micro_batch} {activation_checkpoint}", "sp": "SP2 s{seq_len} mb{micro_batch}",
            "full_size": "full size, {devices} x {hw}, s{seq_len}"}[r["kind"]].format(**r)
    if r["status"] != "ok":
        print(f"  {r['arch']:9s} {what:22s} {r['status']}", flush=True)
    elif r["kind"] == "full_size" and "solve_s" not in r:
        print(f"  {r['arch']:9s} {what:22s} capture {r['capture_s']:.2f} s (not solved: --quick)", flush=True)
    elif r["kind"] == "full_size":
        print(f"  {r['arch']:9s} {what:22s} capture {r['capture_s']:.2f} s, solve {r['solve_s']:.2f} s: sp "
              f"{r['sp_degree']} zero {r['zero_stage']} mb {r['micro_batch']} ({r['plan_checkpoint']})", flush=True)
    else:
        extra = f", loss vs 1 process {r['loss_rel_diff']:.1e}" if r["kind"] == "sp" else ""
        print(f"  {r['arch']:9s} {what:22s} peak {r['peak_rel_err']:+.3%} flops {r['flops_rel_err']:+.3%}"
              f"{extra} ({r['run_s']:.1f} s)", flush=True)


def arch_row(arch: str, rows: pd.DataFrame) -> dict:
    """One architecture's status (`ok`, or why not) and its worst numbers."""
    a = ARCHS[arch]
    mine = rows[rows["arch"] == arch]
    ran = mine[mine["status"] == "ok"]
    runs = ran[ran["kind"].isin(["tiny", "sp"])]
    full = mine[mine["kind"] == "full_size"]
    sp = mine[mine["kind"] == "sp"]

    def worst(col: str, frame: pd.DataFrame = runs) -> float | None:
        xs = frame[col].dropna().abs() if col in frame else pd.Series(dtype=float)
        return float(xs.max()) if len(xs) else None

    out = dict(arch=arch, title=a.title, features="; ".join(a.features), source=a.source,
               tiny_runs_ok=int((ran["kind"] == "tiny").sum()), tiny_runs=int((mine["kind"] == "tiny").sum()),
               peak_max_rel_err=worst("peak_rel_err"), flops_max_rel_err=worst("flops_rel_err"),
               sp_status=sp["status"].iloc[0] if len(sp) else "not run (--quick)",
               sp_loss_rel_diff=worst("loss_rel_diff", ran), capture_s=worst("capture_s", full),
               solve_s=worst("solve_s", full))
    why = []
    errors = mine[mine["status"].str.startswith("error")]
    if len(errors):  # the first error says it all (a capture error fails every cell after it)
        first = errors.iloc[0]
        return out | dict(status=f"error: {first['kind']}: {first['status'].removeprefix('error: ')}")
    checks = (("peak_max_rel_err", "peak", TARGETS["peak_memory_max_rel_err"]),
              ("flops_max_rel_err", "FLOPs", TARGETS["flops_max_rel_err"]),
              ("sp_loss_rel_diff", "SP loss", TARGETS["sp_loss_max_rel_diff"]))
    for key, what, target in checks:
        if out[key] is not None and out[key] > target:
            why.append(f"{what} off by {out[key]:.3g} > {target:g}")
    if out["capture_s"] is not None and out["capture_s"] >= TARGETS["capture_s_max_full_size"]:
        why.append(f"full-size capture {out['capture_s']:.1f} s >= {TARGETS['capture_s_max_full_size']:g} s")
    out["status"] = "ok" if not why else "fail: " + "; ".join(why)
    return out


def summarize(df: pd.DataFrame, archs: pd.DataFrame, quick: bool, wall_s: float) -> dict:
    ok = df[df["status"] == "ok"]
    runs = ok[ok["kind"].isin(["tiny", "sp"])]

    def worst(col: str, frame: pd.DataFrame) -> tuple[float | None, str | None]:
        if col not in frame or frame[col].dropna().empty:
            return None, None
        i = frame[col].abs().idxmax()
        r = frame.loc[i]
        where = f"{r['arch']} {r['kind']} s{int(r['seq_len'])}" + (
            f" mb{int(r['micro_batch'])} {r['activation_checkpoint']}" if r["kind"] != "full_size" else "")
        return float(abs(r[col])), where

    peak, peak_at = worst("peak_rel_err", runs)
    flops, flops_at = worst("flops_rel_err", runs)
    sp, sp_at = worst("loss_rel_diff", ok[ok["kind"] == "sp"])
    cap, cap_at = worst("capture_s", df[df["kind"] == "full_size"])  # also a capture whose solve then failed
    passed = archs[archs["status"] == "ok"]["arch"].tolist()
    failed = {r["arch"]: r["status"] for _, r in archs.iterrows() if r["status"] != "ok"}
    met = (not failed and peak is not None and peak <= TARGETS["peak_memory_max_rel_err"]
           and flops is not None and flops <= TARGETS["flops_max_rel_err"]
           and (quick or (sp is not None and sp <= TARGETS["sp_loss_max_rel_diff"]))
           and cap is not None and cap < TARGETS["capture_s_max_full_size"])
    import transformers

    return {
        "architectures": len(passed),
        "architectures_total": len(archs),
        "architectures_passed": passed,
        "architectures_failed": failed,
        "peak_memory_max_rel_err": peak, "peak_memory_max_rel_err_at": peak_at,
        "flops_max_rel_err": flops, "flops_max_rel_err_at": flops_at,
        "sp_loss_max_rel_diff": sp, "sp_loss_max_rel_diff_at": sp_at,
        "capture_s_max_full_size": cap, "capture_s_max_full_size_at": cap_at,
        "tiny_runs": int((df["kind"] == "tiny").sum()), "tiny_runs_ok": int(((df["kind"] == "tiny")
                                                                             & (df["status"] == "ok")).sum()),
        "sp_runs_ok": int(((df["kind"] == "sp") & (df["status"] == "ok")).sum()),
        "sp_not_offered": {r["arch"]: r["status"].removeprefix("not offered: ") for _, r in df.iterrows()
                           if r["kind"] == "sp" and str(r["status"]).startswith("not offered")},
        "full_size_ok": int(((df["kind"] == "full_size") & (df["status"] == "ok")).sum()),
        "targets": TARGETS,
        "targets_met": bool(met),
        "quick": quick,
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                   "1 torch thread per process",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "tree": tree(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "wall_s": wall_s,
    }


def tree() -> str | None:
    """The commit the benchmark ran at, `+dirty` when the tree had changes (None outside git)."""
    import subprocess

    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("+dirty" if dirty else "")


def private_cache(root: Path) -> None:
    """One trainplan cache for this process and its torchrun workers: the cpu profile
    quick-measured at one thread (only step times depend on it, and this benchmark checks none),
    the tokenizer and token caches linked from the user's; one torch thread everywhere."""
    from trainplan.hardware_profiles import cpu
    from trainplan.hardware_profiles.cache import cache_root

    src = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    for sub in ("tokenizers", "tokens"):
        if (src / sub).exists() and not (root / sub).exists():
            (root / sub).symlink_to((src / sub).resolve(), target_is_directory=True)
    os.environ["TRAINPLAN_CACHE_DIR"] = str(root)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    cpu.save_profile(cpu.measure_cpu(quick=True))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--sp-worker"]:
        sp_worker(*argv[1:4])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="sequence 128 only, no SP runs, full-size configs captured but not solved: about 2 minutes")
    ap.add_argument("--smoke", action="store_true",
                    help="the first architecture (or --arch), one tiny cell, captured full size: the test suite's run")
    ap.add_argument("--out", default="benchmarks/results/models")
    ap.add_argument("--arch", nargs="+", choices=list(ARCHS), metavar="NAME",
                    help=f"only these architectures (default all: {', '.join(ARCHS)})")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    archs = a.arch or (list(ARCHS)[:1] if a.smoke else list(ARCHS))
    t0 = time.perf_counter()
    old_env = {k: os.environ.get(k) for k in ("TRAINPLAN_CACHE_DIR", "OMP_NUM_THREADS")}
    tmp = Path(tempfile.mkdtemp(prefix="trainplan-models-"))
    rows: list[dict] = []
    try:
        private_cache(tmp / "cache")
        from trainplan.executor.data.batches import load_corpus

        data = load_corpus(vocab_size=VOCAB)
        for arch in archs:
            print(f"{arch} ({ARCHS[arch].title})", flush=True)
            try:
                rows += run_arch(arch, data, tmp / "runs", a.quick, a.smoke)
            except Exception as e:  # a bug of this benchmark: the architecture's row says so
                traceback.print_exc()
                rows.append(dict(arch=arch, kind="tiny", status=f"error: benchmark: {one_line(e)}"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    df = pd.DataFrame(rows)
    df.to_csv(out / "models.csv", index=False)
    per_arch = pd.DataFrame([arch_row(arch, df) for arch in archs])
    per_arch.to_csv(out / "models_archs.csv", index=False)
    summary = summarize(df, per_arch, a.quick or a.smoke, time.perf_counter() - t0) | {"smoke": a.smoke}
    (out / "models.json").write_text(json.dumps(summary, indent=2) + "\n")
    table = per_arch[["arch", "tiny_runs_ok", "tiny_runs", "peak_max_rel_err", "flops_max_rel_err",
                      "sp_loss_rel_diff", "capture_s", "solve_s", "status"]].copy()
    table["status"] = [s if len(s) <= 100 else s[:97] + "..." for s in table["status"]]
    print(table.to_string(index=False, justify="left"))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
