"""Predicted maximum trainable context for llama3.1-8b and llama3-70b on one 8-device node, with
and without the long-context knobs, beside published figures.

For each model (llama3.1-8b, llama3-70b), hardware profile (a100, h100, h200, mi300x) and setting
below, the longest sequence (a multiple of 1024 tokens) whose predicted per-device peak tensor
memory fits the profile's usable memory (`hbm_bytes - memory_reserve_bytes`) and, with offload,
whose host bytes fit the device's share of the node's host memory
(`trainplan.costmodels.step.offload.host_limit_bytes`), found by doubling then bisection over
`StepModel.evaluate` (no solver: every knob fixed; the cost models `solve` uses). Memory grows
with the sequence (every term is a polynomial in it with non-negative coefficients), so the
bisection is exact. Common to all: 8 devices, micro-batch 1, bf16 mixed precision, 32-bit AdamW,
the best of ZeRO stages 3, 2, 1, 0 (the stage with the longest context is reported).

Settings (`benchmarks/_context_settings.py`):

- `no_sp`: sp_degree 1 (data parallel over 8, one sequence per device), full checkpointing.
- `sp`: sp_degree 8 (Ulysses over the node, one sequence per node), full checkpointing.
- `sp_seq_aware`: sp_degree 8 with `save_attention` on every block (AutoSP's rule); `full` is
  the least-memory entry, so this buys step time, not context (step times at its maximum).
- `sp_tiled_loss`: `sp` with the LM head and loss over `loss_chunks` chunks;
  `sp_tiled_loss_mlp`: and the MLPs over `mlp_chunks` chunks; `sp_all_knobs`: and activation
  offload to host memory. Chunk counts from `trainplan.planner.joint.space.default_tiling` (llama3.1-8b:
  64 and 4; llama3-70b: 32 and 4).

The model is captured once per (model, precision, device type) on the meta device; the step
model of each profile prices the same regions (all four GPU profiles are `cuda`), and the tiled
regions are traced on first use, once per model.

    python benchmarks/context_table.py [--quick | --smoke] [--out DIR]

`--quick`: llama3.1-8b only; `--smoke`: llama3.1-8b on h100 in the `sp` and `sp_all_knobs`
settings (the test suite's run; the summary keys of the cells it has, the same files).

Writes DIR/context_table.csv (one row per model x hardware x setting: maximum, ZeRO stage, peak
phase, the constraint that binds one step above, the per-device memory breakdown, host bytes and
limit, step time, MFU), DIR/context_table.json (the summary below) and DIR/context_table.md (a
table per model with published figures, the binding phases and what differs from ALST's
setting); prints progress to stderr, then the markdown and the summary. Summary keys:
`{hw}_{model}_{setting}_max_seq_len`, `_zero_stage`, `_memory_phase` (the peak's phase at the
maximum) and `_binds_above` (the limit 1024 tokens more exceeds: `device`, `host`) for model `8b`
and `70b`; the 8b's `{hw}_{setting}_max_seq_len` and `_zero_stage` as before (`mi300` for
mi300x); `h100_8b_max_seq_len_all_knobs` (the h100 8b `sp_all_knobs` maximum),
`h100_8b_all_knobs_target_met` (>= ALST's "3.7M", read as 3.7e6 = 3,700,000 tokens,
`h100_8b_all_knobs_target_tokens`) and its host bytes and limit. Takes about 40 s on 2 cores (a
capture of 2-8 s per model, tiled regions traced in a few seconds each, ~0.02 s per evaluation).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _context_settings, beside this script
from _context_settings import (  # noqa: E402
    ALST_TOKENS,
    COLUMNS_TEXT,
    DEVICES,
    HARDWARE,
    HEADERS,
    LEGACY_HW_KEYS,
    MODELS,
    NO_PUBLISHED,
    PUBLISHED,
    SETTINGS,
    SOURCES,
    alst_differences,
    chunk_counts,
    norm_fp32_bytes,
)

MODEL = MODELS["8b"]
STEP_TOKENS = 1024
MAX_TOKENS = 64 * 2**20  # search ceiling: 64M tokens
GIB = 2**30

_GRAPHS: dict = {}  # (model, precision, device type) -> (graph, parameter numels)
_STEP_MODELS: dict = {}  # (model, hw) -> (profile, precision, graph, StepModel)


def log(msg: str) -> None:
    print(f"[context_table] {msg}", file=sys.stderr, flush=True)


def step_model(model: str, hw: str):
    """(profile, precision, graph, StepModel) of `model` on `hw`: one capture per (model,
    precision, device type), shared by the profiles' step models (a profile only prices regions)."""
    from trainplan.costmodels.step.model import StepModel
    from trainplan.hardware_profiles import load
    from trainplan.planner.capture.setup import capture_model, default_precision

    if (model, hw) not in _STEP_MODELS:
        profile = load(hw)
        precision = default_precision(profile)
        key = (model, precision, profile.device_type)
        if key not in _GRAPHS:
            t0 = time.perf_counter()
            graph, _, numels = capture_model(model, precision, device_type=profile.device_type)
            _GRAPHS[key] = graph, numels
            log(f"captured {model} ({precision}, {profile.device_type}) in {time.perf_counter() - t0:.1f} s")
        graph, numels = _GRAPHS[key]
        sm = StepModel(graph.regions, graph.blocks, numels, profile, n_heads=graph.n_heads,
                       n_kv_heads=graph.n_kv_heads, head_dim=graph.head_dim)
        _STEP_MODELS[model, hw] = profile, precision, graph, sm
    return _STEP_MODELS[model, hw]


class Prediction(NamedTuple):
    """What one evaluated length predicts, in the names of a Plan's predictions."""

    memory_bytes: dict
    memory_phase: str
    memory_limit_bytes: float
    host_memory_bytes: float
    host_memory_limit_bytes: float
    step_time_s: float
    mfu: float


class Point(NamedTuple):
    """One (model, hw, knobs, length) evaluated: its predictions, step cost and choice."""

    predictions: Prediction
    cost: object
    choice: object


def plan_at(hw: str, seq_len: int, *, sp_degree: int, checkpoint: str, zero_stage: int, model: str = MODEL,
            tiled_loss: bool = False, tiled_mlp: bool = False, offload: bool = False) -> Point:
    """The step model's predictions for one length with every knob fixed (nothing runs)."""
    from trainplan.costmodels.step.model import Choice
    from trainplan.costmodels.step.offload import host_limit_bytes
    from trainplan.planner.capture.setup import PRECISION_DTYPE

    profile, precision, graph, sm = step_model(model, hw)
    kl, km = chunk_counts(graph, 2 if precision != "fp32" else 4, profile.unified_memory)
    c = Choice(sp_degree=sp_degree, zero_stage=zero_stage, micro_batch=1, seq_len=seq_len,
               policies=(checkpoint,) * graph.n_layers, precision=precision, optimizer_bits=32,
               devices=DEVICES, loss_chunks=kl if tiled_loss else 1, mlp_chunks=km if tiled_mlp else 1,
               offload=offload)
    cost = sm.evaluate(c)
    peak = profile.peak(PRECISION_DTYPE[precision])
    p = Prediction(memory_bytes=cost.memory.as_dict(), memory_phase=cost.memory.phase,
                   memory_limit_bytes=float(profile.usable_bytes), host_memory_bytes=cost.host_bytes,
                   host_memory_limit_bytes=0.0 if profile.unified_memory else host_limit_bytes(profile),
                   step_time_s=cost.time_s, mfu=cost.model_flops / (cost.time_s * peak) if cost.time_s else 0.0)
    return Point(predictions=p, cost=cost, choice=c)


def fits(plan) -> bool:
    """Device memory fits and, when anything is offloaded, host memory too (a Plan or a Point)."""
    p = plan.predictions
    if p.memory_bytes["total"] > p.memory_limit_bytes:
        return False
    host = getattr(p, "host_memory_bytes", 0.0)  # absent: nothing offloaded
    return not host or host <= p.host_memory_limit_bytes


def binds(plan) -> str:
    """Which limit a length that does not fit exceeds: `device`, `host` or `device+host`."""
    p = plan.predictions
    dev = p.memory_bytes["total"] > p.memory_limit_bytes
    host = bool(p.host_memory_bytes) and p.host_memory_bytes > p.host_memory_limit_bytes
    return "+".join(x for x, over in (("device", dev), ("host", host)) if over) or "none"


def max_context(hw: str, **knobs) -> tuple[int, object | None, int]:
    """Longest multiple of STEP_TOKENS that fits, its plan, and the number of lengths evaluated.
    0 and None when not even STEP_TOKENS fits. Assumes memory grows with the length (it does:
    every term is a polynomial in the sequence with non-negative coefficients)."""
    cache: dict[int, object] = {}

    def ok(k: int) -> bool:
        if k not in cache:
            cache[k] = plan_at(hw, k * STEP_TOKENS, **knobs)
        return fits(cache[k])

    if not ok(1):
        return 0, None, len(cache)
    lo, hi = 1, 2
    while hi * STEP_TOKENS <= MAX_TOKENS and ok(hi):
        lo, hi = hi, hi * 2
    if hi * STEP_TOKENS > MAX_TOKENS:
        return lo * STEP_TOKENS, cache[lo], len(cache)  # ceiling reached
    while hi - lo > 1:  # ok(lo) and not ok(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo * STEP_TOKENS, cache[lo], len(cache)


def best_stage(model: str, hw: str, setting: dict) -> tuple[int, Point | None, int, int]:
    """(tokens, point, ZeRO stage, lengths evaluated) of the stage with the longest context."""
    best, n = None, 0
    for zero in (3, 2, 1, 0):  # 3 first: it shards the most, so the others rarely beat it
        if best is not None and best[0] and not fits(plan_at(
                hw, best[0] + STEP_TOKENS, model=model, zero_stage=zero, **setting)):
            continue  # this stage cannot beat the best so far (memory grows with length)
        tokens, plan, k = max_context(hw, model=model, zero_stage=zero, **setting)
        n += k
        if best is None or tokens > best[0]:
            best = (tokens, plan, zero)
    return (*best, n)


def table_rows(models: dict = MODELS, hardware: tuple = HARDWARE, settings: tuple = tuple(SETTINGS)) -> list[dict]:
    """One row per model x hardware x setting (the names of `MODELS`, `HARDWARE`, `SETTINGS`)."""
    rows = []
    for short, model in models.items():
        for hw in hardware:
            for name, setting in ((n, SETTINGS[n]) for n in settings):
                t0 = time.perf_counter()
                tokens, plan, zero, n = best_stage(model, hw, setting)
                nxt = plan_at(hw, tokens + STEP_TOKENS, model=model, zero_stage=zero, **setting)
                c = nxt.choice
                row = dict(model=model, model_short=short, hw=hw, setting=name, sp_degree=setting["sp_degree"],
                           checkpoint=setting["checkpoint"], loss_chunks=c.loss_chunks, mlp_chunks=c.mlp_chunks,
                           offload=c.offload, zero_stage=zero, max_seq_len=tokens)
                row["binds_above"] = binds(nxt) if tokens + STEP_TOKENS <= MAX_TOKENS else "search ceiling"
                row["memory_phase_above"] = nxt.predictions.memory_phase
                if plan is None:  # what does not fit at the shortest length: the model states, mostly
                    m = nxt.predictions.memory_bytes
                    row.update(peak_at_1k_bytes=m["total"], usable_bytes=nxt.predictions.memory_limit_bytes,
                               states_at_1k_bytes=m["params"] + m["grads"] + m["optimizer"])
                else:
                    p = plan.predictions
                    row.update(peak_memory_bytes=p.memory_bytes["total"], usable_bytes=p.memory_limit_bytes,
                               memory_phase=p.memory_phase, host_bytes=p.host_memory_bytes,
                               host_limit_bytes=p.host_memory_limit_bytes, step_time_s=p.step_time_s, mfu=p.mfu,
                               **{f"memory_{k}_bytes": v for k, v in p.memory_bytes.items() if k != "total"})
                    if setting["checkpoint"] != "full":  # what the sequence-aware entry buys
                        full = plan_at(hw, tokens, model=model, zero_stage=zero, **(setting | {"checkpoint": "full"}))
                        row["step_time_full_ac_same_len_s"] = full.predictions.step_time_s
                rows.append(row)
                log(f"{model} {hw} {name}: {fmt_tokens(tokens)} (ZeRO-{zero}, {row.get('memory_phase', '-')}), "
                    f"{n} lengths, {time.perf_counter() - t0:.1f} s")
    return rows


def alst_facts(df: pd.DataFrame) -> dict:
    """The facts behind `alst_differences`, at the h100 8b all-knobs maximum and at 3.7e6 tokens."""
    r = df[(df.model_short == "8b") & (df.hw == "h100") & (df.setting == "sp_all_knobs")].iloc[0]
    setting, zero, tokens = SETTINGS["sp_all_knobs"], int(r.zero_stage), int(r.max_seq_len)
    profile, _, graph, sm = step_model(MODEL, "h100")
    target_len = math.ceil(ALST_TOKENS / STEP_TOKENS) * STEP_TOKENS
    at = plan_at("h100", target_len, zero_stage=zero, **setting).predictions
    f = dict(max_seq_len=tokens, target_len=target_len, peak_at_target_bytes=at.memory_bytes["total"],
             phase_at_target=at.memory_phase, host_at_target_bytes=at.host_memory_bytes,
             usable_bytes=float(profile.usable_bytes), host_limit_bytes=r.host_limit_bytes,
             node_host_bytes=profile.host_memory_bytes, host_bytes=r.host_bytes,
             reserve_bytes=profile.memory_reserve_bytes, phase=r.memory_phase, zero_stage=zero,
             loss_chunks=int(r.loss_chunks), mlp_chunks=int(r.mlp_chunks), params_bytes=r.memory_params_bytes,
             grads_bytes=r.memory_grads_bytes, optimizer_bytes=r.memory_optimizer_bytes)
    f["states_bytes"] = f["params_bytes"] + f["grads_bytes"] + f["optimizer_bytes"]
    for key, length in (("", tokens), ("_at_target", target_len)):  # block 0's fp32 norm copies
        c = plan_at("h100", max(length, STEP_TOKENS), zero_stage=zero, **setting).choice
        s = c.seq_len // c.sp_degree
        region = graph.regions[sm.region_for(c, graph.blocks[0], c.entry(c.policies[0]))]
        f[f"norm_fp32{key}_bytes"] = norm_fp32_bytes(region, 1, s, graph.hidden_size)
        f[f"hidden{key}_bytes"] = 2 * s * graph.hidden_size
    return f


def fmt_tokens(n: int) -> str:
    if n == 0:
        return "does not fit"
    return f"{n / 2**20:.2f}M" if n >= 2**20 else f"{n // 1024}K"


def binding_note(df: pd.DataFrame) -> str:
    """Which phase of the step sets the predicted peak at the maxima, and which limit binds."""
    fit = df[df["max_seq_len"] > 0]
    parts = []
    for name in dict.fromkeys(df.setting):
        sub = fit[fit.setting == name]
        if len(sub):
            phases = ", ".join(f"{k} x{v}" for k, v in sub.memory_phase.value_counts().items())
            limits = ", ".join(f"{k} x{v}" for k, v in sub.binds_above.value_counts().items())
            parts.append(f"*{HEADERS[name]}*: peak in {phases}; one step above exceeds {limits}")
    none = df[df.max_seq_len == 0].groupby(["model", "hw"]).setting.count()
    tail = (f" Nothing fits, not even {STEP_TOKENS} tokens: "
            + ", ".join(f"{m} on {hw} ({k} of {len(SETTINGS)} settings)" for (m, hw), k in none.items())
            + "; the model states alone (parameters, gradients, optimizer at the peak, ZeRO-3 over 8) exceed "
            "the usable memory there (cells: the peak and the states at 1K tokens)." if len(none) else "")
    return ("Binding at the maxima (phase of the predicted peak: `tail` = final norm, LM head and loss; "
            "`bwd:blockN` = block N's backward with its recompute: the first of the backward (block 31 or 79) "
            "while every block's checkpointed input is still on the device, the last (block 0) once offload has "
            "moved those inputs to host memory; counts over models and hardware; "
            "the limit a length 1024 tokens longer exceeds, `device` memory or `host` memory): "
            + "; ".join(parts) + "." + tail)


def cell(r) -> str:
    text = f"{fmt_tokens(int(r.max_seq_len))} (ZeRO-{int(r.zero_stage)}"
    if r.max_seq_len == 0:
        text += f"; at 1K: {r.peak_at_1k_bytes / GIB:.0f} GiB, states {r.states_at_1k_bytes / GIB:.0f} GiB"
    else:
        text += f", {r.memory_phase}"
        if r.offload:
            text += f", host {r.host_bytes / GIB:.0f}/{r.host_limit_bytes / GIB:.0f} GiB"
        if r.binds_above == "host":
            text += ", host binds"
        if r.setting == "sp_seq_aware":
            text += f"; step {r.step_time_s:.0f} s vs {r.step_time_full_ac_same_len_s:.0f} s with full AC"
    return text + ")"


def markdown(df: pd.DataFrame) -> str:
    lines = [
        f"Predicted maximum trainable context on {DEVICES} devices of one node: micro-batch 1, bf16 "
        "mixed precision, 32-bit AdamW, best ZeRO stage, sequence a multiple of "
        f"{STEP_TOKENS} tokens (K = 1024 tokens, M = 2^20 tokens; ALST's 3.7M is read as 3.7e6 = "
        f"{fmt_tokens(ALST_TOKENS)} here). `python benchmarks/context_table.py`.",
    ]
    names = list(dict.fromkeys(df.setting))
    for short, model in dict(zip(df.model_short, df.model, strict=True)).items():
        sub = df[df.model_short == short]
        tiles = sub[sub.setting == "sp_all_knobs"].iloc[0]
        lines += ["", f"**{model}** (loss_chunks {tiles.loss_chunks}, mlp_chunks {tiles.mlp_chunks})", "",
                  "| hardware (usable GiB) | " + " | ".join(HEADERS[n] for n in names)
                  + " | published (settings differ) |",
                  "|---|" + "---|" * (len(names) + 1)]
        for hw in dict.fromkeys(sub.hw):
            rows = sub[sub.hw == hw].set_index("setting")
            usable = rows["usable_bytes"].dropna()
            head = f"8 x {hw} ({usable.iloc[0] / GIB:.0f})" if len(usable) else f"8 x {hw}"
            cells = [cell(next(rows[rows.index == n].reset_index().itertuples())) for n in names]
            lines.append(f"| {head} | " + " | ".join(cells) + f" | {PUBLISHED.get((short, hw), NO_PUBLISHED)} |")
    lines += ["", COLUMNS_TEXT, "", binding_note(df), "", *alst_differences(alst_facts(df)), "", *SOURCES]
    return "\n".join(lines)


def summary_of(df: pd.DataFrame) -> dict:
    out: dict = {}
    for r in df[df.model_short == "8b"].itertuples():  # the keys before llama3-70b was added
        out[f"{LEGACY_HW_KEYS.get(r.hw, r.hw)}_{r.setting}_max_seq_len"] = int(r.max_seq_len)
        out[f"{LEGACY_HW_KEYS.get(r.hw, r.hw)}_{r.setting}_zero_stage"] = int(r.zero_stage)
    for r in df.itertuples():
        key = f"{r.hw}_{r.model_short}_{r.setting}"
        out[f"{key}_max_seq_len"] = int(r.max_seq_len)
        out[f"{key}_zero_stage"] = int(r.zero_stage)
        out[f"{key}_memory_phase"] = r.memory_phase if r.max_seq_len else None
        out[f"{key}_binds_above"] = r.binds_above
    top = df[(df.model_short == "8b") & (df.hw == "h100") & (df.setting == "sp_all_knobs")].iloc[0]
    out.update(h100_8b_max_seq_len_all_knobs=int(top.max_seq_len),
               h100_8b_all_knobs_target_tokens=ALST_TOKENS,
               h100_8b_all_knobs_target_met=bool(top.max_seq_len >= ALST_TOKENS),
               h100_8b_all_knobs_host_bytes=float(top.host_bytes),
               h100_8b_all_knobs_host_limit_bytes=float(top.host_limit_bytes))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="llama3.1-8b only, every profile and setting")
    ap.add_argument("--smoke", action="store_true",
                    help="llama3.1-8b on h100, the sp and sp_all_knobs settings (for the test suite)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    t0 = time.perf_counter()
    small = {"8b": MODELS["8b"]}
    if a.smoke:
        df = pd.DataFrame(table_rows(small, ("h100",), ("sp", "sp_all_knobs")))
    else:
        df = pd.DataFrame(table_rows(small) if a.quick else table_rows())
    df.to_csv(out / "context_table.csv", index=False)
    md = markdown(df)
    (out / "context_table.md").write_text(md + "\n")
    summary = summary_of(df)
    summary.update({
        "models": list(dict.fromkeys(df.model)), "hardware": list(dict.fromkeys(df.hw)), "devices": DEVICES,
        "micro_batch": 1,
        "precision": "bf16-mixed", "optimizer_bits": 32, "wall_s": time.perf_counter() - t0,
        "quick": a.quick, "smoke": a.smoke,
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                   f"{os.cpu_count()} cores",
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    })
    (out / "context_table.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(md)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
