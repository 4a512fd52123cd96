"""Predicted maximum trainable context for llama3.1-8b on one 8-device node, beside published
figures.

For each hardware profile (a100, h100, mi300) and each setting below, the longest sequence
(a multiple of 1024 tokens) whose predicted per-device peak tensor memory fits the profile's
usable memory (`hbm_bytes - memory_reserve_bytes`), found by doubling then bisection over
`planner.api.plan_for_choice` (no solver: every knob fixed, predictions from the same cost
models `solve` uses). Common to all: 8 devices, micro-batch 1, bf16 mixed precision, 32-bit
AdamW, the best of ZeRO stages 0-3 (the stage with the longest context is reported).

- `no_sp`: sp_degree 1 (data parallel over 8, one sequence per device), full activation
  checkpointing of every block (the usual long-context baseline).
- `sp`: sp_degree 8 (Ulysses over the node, one sequence per node), full checkpointing.
- `sp_seq_aware`: sp_degree 8 with the sequence-aware entry `save_attention` on every block
  (AutoSP's rule: keep attention outputs, recompute the rest, so attention, the quadratic
  term, is never recomputed). In trainplan's menu `full` is the least-memory entry, so this
  column can only be shorter than `sp`: it buys step time, not context; the step times at its
  maximum show how much.

    python benchmarks/context_table.py [--out DIR]

Writes DIR/context_table.csv (one row per hardware x setting), DIR/context_table.json (summary)
and DIR/context_table.md (the markdown table with published figures); prints the table and
then the summary. Takes one to two minutes on 2 cores (a capture per profile, then\n~0.3 s per plan).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path

import pandas as pd
import torch

MODEL = "llama3.1-8b"
DEVICES = 8
HARDWARE = ("a100", "h100", "mi300")
STEP_TOKENS = 1024
MAX_TOKENS = 64 * 2**20  # search ceiling: 64M tokens
GIB = 2**30

SETTINGS = {
    "no_sp": dict(sp_degree=1, checkpoint="full"),
    "sp": dict(sp_degree=DEVICES, checkpoint="full"),
    "sp_seq_aware": dict(sp_degree=DEVICES, checkpoint="save_attention"),
}
LABELS = {
    "no_sp": "no SP (full AC)",
    "sp": "SP 8 (full AC)",
    "sp_seq_aware": "SP 8 + sequence-aware AC (save_attention)",
}

PUBLISHED = {
    "a100": (
        "AutoSP (Llama 3.1 on 8 x A100-80GB; compiler-based Ulysses + sequence-aware AC): up to "
        "2.7x longer trainable context than hand-written baselines (ZeRO-3 and "
        "RingFlashAttention, per the PyTorch blog's summary) [1]; absolute lengths not verified. "
        "DeepSpeed-Ulysses: 1M tokens for a 1.2B GPT on up "
        "to 64 A100-40GB [2] (other model, 8x the GPUs)."
    ),
    "h100": (
        "ALST (Llama 8B; Ulysses SP with tiled MLP, tiled loss and activation offload to CPU "
        "memory): 3.7M tokens on one 8 x H100-80GB node, 500K on one H100; an out-of-box "
        "Hugging Face run of Llama 8B runs out of memory above 32K [3]."
    ),
    "mi300": (
        "AutoSP on AMD hardware: up to 2.5x longer trainable context than hand-written "
        "baselines [1]; the GPU model and absolute lengths not verified."
    ),
}
SOURCES = (
    "[1] Gupta, Tanaka, Zhang et al. 2026, \"AutoSP: Unlocking Long-Context LLM Training Via "
    "Compiler-Based Sequence Parallelism\", ICLR 2026, arXiv:2604.27089, abstract; PyTorch blog "
    "\"Introducing AutoSP\" (Llama 3.1 on 8 x A100-80GB).",
    "[2] Jacobs et al. 2023, \"DeepSpeed Ulysses: System Optimizations for Enabling Training of "
    "Extreme Long Sequence Transformer Models\", arXiv:2309.14509; DeepSpeed-Ulysses README "
    "(\"strong scaling of sequence length up to 1 million tokens on 1.2 billion parameter GPT "
    "model\", \"up to 64 A100 GPUs with 40GB memory\").",
    "[3] Bekman et al. 2025, \"Arctic Long Sequence Training: Scalable And Efficient Training "
    "For Multi-Million Token Sequences\", arXiv:2506.13996, abstract; Snowflake engineering blog; "
    "the technique list as in axolotl's examples/alst/README.md.",
)


def plan_at(hw: str, seq_len: int, *, sp_degree: int, checkpoint: str, zero_stage: int):
    """The fixed-knob plan for one length (predictions only, nothing runs)."""
    from planner.api import plan_for_choice

    return plan_for_choice(MODEL, hw, seq_len=seq_len, micro_batch=1, checkpoint=checkpoint,
                           sp_degree=sp_degree, devices=DEVICES, zero_stage=zero_stage,
                           precision="bf16-mixed", optimizer_bits=32, max_steps=1)


def fits(plan) -> bool:
    p = plan.predictions
    return p.memory_bytes["total"] <= p.memory_limit_bytes


def max_context(hw: str, **knobs) -> tuple[int, object | None, int]:
    """Longest multiple of STEP_TOKENS that fits, its plan, and the number of plans made.
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


def table_rows() -> list[dict]:
    rows = []
    for hw in HARDWARE:
        for name, setting in SETTINGS.items():
            best = None
            for zero in (3, 2, 1, 0):  # 3 first: it shards the most, so the others rarely beat it
                if best is not None and best[0] and not fits(plan_at(
                        hw, best[0] + STEP_TOKENS, zero_stage=zero, **setting)):
                    continue  # this stage cannot beat the best so far (memory grows with length)
                tokens, plan, _ = max_context(hw, zero_stage=zero, **setting)
                if best is None or tokens > best[0]:
                    best = (tokens, plan, zero)
            tokens, plan, zero = best
            row = dict(hw=hw, setting=name, sp_degree=setting["sp_degree"],
                       checkpoint=setting["checkpoint"], zero_stage=zero, max_seq_len=tokens)
            if plan is not None:
                p = plan.predictions
                row.update(peak_memory_bytes=p.memory_bytes["total"],
                           usable_bytes=p.memory_limit_bytes, memory_phase=p.memory_phase,
                           step_time_s=p.step_time_s, mfu=p.mfu,
                           **{f"memory_{k}_bytes": v for k, v in p.memory_bytes.items() if k != "total"})
                # the same length under full checkpointing: what the sequence-aware entry saves
                if setting["checkpoint"] != "full":
                    full = plan_at(hw, tokens, sp_degree=setting["sp_degree"], checkpoint="full",
                                   zero_stage=zero)
                    row["step_time_full_ac_same_len_s"] = full.predictions.step_time_s
            rows.append(row)
    return rows


def fmt_tokens(n: int) -> str:
    if n == 0:
        return "does not fit"
    return f"{n / 2**20:.2f}M" if n >= 2**20 else f"{n // 1024}K"


def binding_note(df: pd.DataFrame) -> str:
    """Which phase of the step sets the predicted peak at the maxima, and its bytes per token."""
    fit = df[df["max_seq_len"] > 0]
    phases = sorted(set(fit["memory_phase"]))
    tail = fit[fit["memory_phase"] == "tail"]
    if phases != ["tail"] or tail.empty:
        return f"Predicted peak phases at the maxima: {', '.join(phases)}."
    local = tail["max_seq_len"] / tail["sp_degree"]
    per_token = (tail["memory_activations_bytes"] + tail["memory_temporaries_bytes"]) / local
    return ("At every maximum the predicted peak falls in the tail (final norm, logits over the "
            "128,256-token vocabulary and the cross-entropy, forward and backward): "
            f"{per_token.min() / 2**20:.1f}-{per_token.max() / 2**20:.1f} MiB of activations and "
            "temporaries per token on the device, so the limit is the loss head, not attention or "
            "the blocks; SP 8 divides it by 8. A chunked (tiled) loss, as ALST uses, is not in "
            "trainplan's menu.")


def markdown(df: pd.DataFrame) -> str:
    lines = [
        f"Predicted maximum trainable context, `{MODEL}` on 8 devices of one node: micro-batch 1, "
        "bf16 mixed precision, 32-bit AdamW, best ZeRO stage (in brackets), sequence a multiple "
        f"of {STEP_TOKENS} tokens (K = 1024 tokens, M = 2^20). `python benchmarks/context_table.py`.",
        "",
        "| hardware (usable GiB) | no SP, full AC | SP 8, full AC | SP 8, sequence-aware AC | "
        "published (settings differ) |",
        "|---|---|---|---|---|",
    ]
    for hw in HARDWARE:
        sub = df[df["hw"] == hw].set_index("setting")
        usable = sub["usable_bytes"].dropna()
        head = f"8 x {hw} ({usable.iloc[0] / GIB:.0f})" if len(usable) else f"8 x {hw}"
        cells = []
        for name in SETTINGS:
            r = sub.loc[name]
            cell = f"{fmt_tokens(int(r['max_seq_len']))} (ZeRO-{int(r['zero_stage'])})"
            if name == "sp_seq_aware" and r["max_seq_len"] > 0:
                cell += (f"; step {r['step_time_s']:.0f} s vs {r['step_time_full_ac_same_len_s']:.0f} s "
                         "with full AC")
            cells.append(cell)
        lines.append(f"| {head} | " + " | ".join(cells) + f" | {PUBLISHED[hw]} |")
    lines += [
        "",
        "Columns: *no SP*: sp_degree 1, data parallel over 8, one sequence per device, every block "
        "fully checkpointed. *SP 8*: Ulysses over the 8 devices, one sequence per node, full "
        "checkpointing. *Sequence-aware AC*: SP 8 with `save_attention` on every block (keep "
        "attention outputs, recompute the rest; AutoSP's rule); `full` is the least-memory entry of "
        "trainplan's menu, so this column trades context for step time (predicted step at its "
        "maximum beside full checkpointing at the same length). Fit: predicted per-device peak "
        "tensor bytes <= the profile's usable bytes (HBM minus its reserve); not measured on "
        "these GPUs. The published systems use techniques trainplan does not model (tiled MLP and "
        "loss, activation offload to CPU memory, compiler passes), other models or other GPU "
        "counts: read them as context, not as a check.",
        "",
        binding_note(df),
        "",
        "Not modelled, so these maxima are optimistic by a little: FSDP2 (ZeRO-3) keeps the root "
        "module's parameters (embedding and lm_head, 2 x 128,256 x 4,096 bf16 = 1.96 GiB) "
        "unsharded from the forward to the end of the backward, and lm_head's full-size gradient "
        "until the root's reduce-scatter there (measured on CPU by `benchmarks/sp.py`).",
        "",
        *SOURCES,
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    df = pd.DataFrame(table_rows())
    df.to_csv(out / "context_table.csv", index=False)
    md = markdown(df)
    (out / "context_table.md").write_text(md + "\n")
    summary = {f"{r.hw}_{r.setting}_max_seq_len": int(r.max_seq_len) for r in df.itertuples()}
    summary.update({f"{r.hw}_{r.setting}_zero_stage": int(r.zero_stage) for r in df.itertuples()})
    summary.update({
        "model": MODEL, "devices": DEVICES, "micro_batch": 1, "precision": "bf16-mixed",
        "optimizer_bits": 32, "wall_s": time.perf_counter() - t0, "quick": False,
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
