"""What `benchmarks/context_table.py` compares: the models, hardware profiles and knob settings of
the predicted-maximum-context table, the published figures beside it with their sources, and the
text on what differs from ALST's setting (Bekman et al. 2025, arXiv:2506.13996).

Each setting is a dict of `trainplan.costmodels.step.model.Choice` knobs less the shape and the ZeRO stage
(the table searches those): `sp_degree`, `checkpoint` (one menu entry for every block) and the
long-context knobs `tiled_loss`, `tiled_mlp`, `offload` (booleans: the chunk counts are
`trainplan.planner.joint.space.default_tiling`'s for the model, `chunk_counts`).
"""

from __future__ import annotations

from trainplan.planner.joint.space import default_tiling

DEVICES = 8
MODELS = {"8b": "llama3.1-8b", "70b": "llama3-70b"}
"""Short name (in summary keys) -> `trainplan.modeling.presets` name."""
HARDWARE = ("a100", "h100", "h200", "mi300x")
LEGACY_HW_KEYS = {"mi300x": "mi300"}
"""Profile -> the name the 8b summary keys used before h200 was added (`mi300` is `mi300x`'s
alias), so `mi300_sp_max_seq_len` still means what it meant."""
ALST_TOKENS = 3_700_000
"""ALST's published maximum for Llama 8B on one 8 x H100 node, "3.7M" read as 3.7e6 tokens [3]."""

_SP = dict(sp_degree=DEVICES, checkpoint="full")
SETTINGS = {
    "no_sp": dict(sp_degree=1, checkpoint="full"),
    "sp": _SP,
    "sp_seq_aware": dict(sp_degree=DEVICES, checkpoint="save_attention"),
    "sp_tiled_loss": _SP | dict(tiled_loss=True),
    "sp_tiled_loss_mlp": _SP | dict(tiled_loss=True, tiled_mlp=True),
    "sp_all_knobs": _SP | dict(tiled_loss=True, tiled_mlp=True, offload=True),
}
HEADERS = {
    "no_sp": "no SP, full AC",
    "sp": "SP 8, full AC",
    "sp_seq_aware": "SP 8, sequence-aware AC",
    "sp_tiled_loss": "SP 8, full AC, tiled loss",
    "sp_tiled_loss_mlp": "+ tiled MLP",
    "sp_all_knobs": "+ offload (all knobs)",
}
COLUMNS_TEXT = (
    "Columns: *no SP*: sp_degree 1, data parallel over 8, one sequence per device, every block "
    "fully checkpointed. *SP 8*: Ulysses over the 8 devices, one sequence per node, full "
    "checkpointing. *Sequence-aware AC*: SP 8 with `save_attention` on every block (keep attention "
    "outputs, recompute the rest; AutoSP's rule); `full` is the least-memory entry of trainplan's "
    "menu, so this column trades context for step time (predicted step at its maximum beside full "
    "checkpointing at the same length). *Tiled loss*: SP 8, full AC, the LM head and loss over "
    "`loss_chunks` sequence chunks (`trainplan.modeling.tiling`, the traced `tail@l{k}`). *+ tiled MLP*: and "
    "every block's MLP over `mlp_chunks` chunks (`block@m{k}`). *+ offload*: and every block's "
    "checkpointed input held in host memory (`trainplan.costmodels.step.offload`); a length fits only if the "
    "host bytes fit the device's share of the node's host memory too (`host_limit_bytes`: "
    "`host_memory_bytes` / `devices_per_node`). Chunk counts: `trainplan.planner.joint.space.default_tiling`'s "
    "rule, one count per knob. In each cell: the best ZeRO stage, the step phase of the predicted "
    "peak at the maximum and, with offload, host GiB used of the limit. Fit: predicted per-device "
    "peak tensor bytes <= the profile's usable bytes (HBM minus its reserve); not measured on these "
    "GPUs.")

PUBLISHED = {
    ("8b", "a100"): (
        "AutoSP (Llama 3.1 on 8 x A100-80GB; compiler-based Ulysses + sequence-aware AC): up to "
        "2.7x longer trainable context than hand-written baselines (ZeRO-3 and "
        "RingFlashAttention, per the PyTorch blog's summary) [1]; absolute lengths not verified. "
        "DeepSpeed-Ulysses: 1M tokens for a 1.2B GPT on up "
        "to 64 A100-40GB [2] (other model, 8x the GPUs)."),
    ("8b", "h100"): (
        "ALST (Llama 8B; Ulysses SP with tiled MLP, tiled loss and activation offload to CPU "
        "memory): 3.7M (read as 3.7e6) tokens on one 8 x H100-80GB node, 500K on one H100; an "
        "out-of-box Hugging Face run of Llama 8B runs out of memory above 32K [3]."),
    ("8b", "mi300x"): (
        "AutoSP on AMD hardware: up to 2.5x longer trainable context than hand-written "
        "baselines [1]; the GPU model and absolute lengths not verified."),
}
NO_PUBLISHED = "none cited"
SOURCES = (
    "[1] Gupta, Tanaka, Zhang et al. 2026, \"AutoSP: Unlocking Long-Context LLM Training Via "
    "Compiler-Based Sequence Parallelism\", ICLR 2026, arXiv:2604.27089, abstract; PyTorch blog "
    "\"Introducing AutoSP\" (Llama 3.1 on 8 x A100-80GB).",
    "[2] Jacobs et al. 2023, \"DeepSpeed Ulysses: System Optimizations for Enabling Training of "
    "Extreme Long Sequence Transformer Models\", arXiv:2309.14509; DeepSpeed-Ulysses README "
    "(\"strong scaling of sequence length up to 1 million tokens on 1.2 billion parameter GPT "
    "model\", \"up to 64 A100 GPUs with 40GB memory\").",
    "[3] Bekman et al. 2025, \"Arctic Long Sequence Training: Scalable And Efficient Training "
    "For Multi-Million Token Sequences\", arXiv:2506.13996, abstract (\"3.7M on a single 8xH100 "
    "GPU node\"); Snowflake engineering blog; the technique list as in axolotl's "
    "examples/alst/README.md.",
)


def chunk_counts(graph, act_bytes: int, unified_memory: bool) -> tuple[int, int]:
    """(loss_chunks, mlp_chunks) when on: the tiled values of `default_tiling` for `graph`'s shape
    at `act_bytes` per activation element (2 under bf16 mixed precision)."""
    t = default_tiling(vocab_size=graph.vocab_size, hidden_size=graph.hidden_size,
                       intermediate_size=graph.intermediate_size, act_bytes=act_bytes,
                       unified_memory=unified_memory)
    return max(t["loss_chunks"]), max(t["mlp_chunks"])


def norm_fp32_bytes(region, b: int, s: int, hidden: int) -> float:
    """Bytes of `region`'s forward `aten._to_copy` outputs of fp32 hidden-state size (4 x b x s x
    h) kept for its backward: the RMSNorms' fp32 upcasts of HF's eager LlamaRMSNorm as the capture
    traces them (a checkpointed block remakes them in its recompute and holds them to their
    backward use)."""
    from trainplan.costmodels.step.memory import poly_at

    size = 4 * b * s * hidden
    return sum(size for r in region.storages
               if r.category == "act" and r.last_use > region.boundary and poly_at(r.bytes, b, s) == size
               and "_to_copy" in str(region.graph.nodes.get(r.creator, {}).get("op", "")))


def alst_differences(f: dict) -> list[str]:
    """The markdown on what differs from ALST's setting, from the facts `f` measured by the
    benchmark at the h100 8b all-knobs maximum (keys as `context_table.alst_facts` returns)."""
    gib = 2**30
    return [
        "**What differs from ALST's setting** (h100, llama3.1-8b, all knobs). ALST's abstract "
        "states 3.7M tokens for Llama 8B on one 8 x H100 node [3]; trainplan predicts "
        f"{f['max_seq_len']:,} tokens ({f['max_seq_len'] / 1e6:.2f}e6), "
        f"{'meeting' if f['max_seq_len'] >= ALST_TOKENS else 'below'} the 3.7e6 target. At 3.7e6 "
        f"tokens (rounded up to {f['target_len']:,}) the predicted per-device peak is "
        f"{f['peak_at_target_bytes'] / gib:.1f} GiB of {f['usable_bytes'] / gib:.1f} usable "
        f"(phase {f['phase_at_target']}), host {f['host_at_target_bytes'] / gib:.0f} of "
        f"{f['host_limit_bytes'] / gib:.0f} GiB. What trainplan's model assumes, as facts of the model:",
        "",
        "- *Modules*: Hugging Face's eager Llama modules as the capture traces them (flash SDPA, "
        "the cuda kernels). Each RMSNorm upcasts the hidden states to fp32 and autograd keeps that "
        f"copy for the backward: at the maximum, the two norms of block 0 hold "
        f"{f['norm_fp32_bytes'] / gib:.1f} GiB per device from the block's recompute to their "
        f"backward use, against {f['hidden_bytes'] / gib:.1f} GiB for the bf16 hidden states "
        f"themselves; the peak falls in `{f['phase']}`. For scale: at 3.7e6 tokens these copies are "
        f"{f['norm_fp32_at_target_bytes'] / gib:.1f} GiB, the predicted peak "
        f"{(f['peak_at_target_bytes'] - f['usable_bytes']) / gib:.1f} GiB over the usable memory. Whether "
        "ALST's runs kept fp32 copies of the hidden states in their norms is not verified.",
        f"- *Tiling*: one chunk count per knob, `default_tiling`'s rule (loss_chunks "
        f"{f['loss_chunks']}, mlp_chunks {f['mlp_chunks']}: a chunk's largest tensor about the size "
        "of the hidden states); ALST's tile counts are not verified.",
        "- *Offload*: every checkpointed block's input in host memory, with one block input in "
        "flight on the device in each block phase (and in the tail); host "
        f"{f['host_bytes'] / gib:.0f} GiB per device of its {f['host_limit_bytes'] / gib:.0f} GiB "
        f"share of the node's {f['node_host_bytes'] / gib:,.0f} GiB (the h100 profile's, DGX H100 "
        "datasheet). ALST's offload schedule is not verified.",
        f"- *Reserve*: {f['reserve_bytes'] / gib:.0f} GiB per device kept out of the HBM for "
        "driver, context, NCCL buffers and fragmentation (the h100 profile's engineering estimate).",
        f"- *Model states*: ZeRO-{f['zero_stage']} (FSDP2) over 8 devices, bf16 mixed precision with "
        "fp32 master weights, fp32 gradients and fp32 AdamW states: at the peak "
        f"{f['states_bytes'] / gib:.1f} GiB per device (params {f['params_bytes'] / gib:.1f}, grads "
        f"{f['grads_bytes'] / gib:.1f}, optimizer {f['optimizer_bytes'] / gib:.1f}). ALST's "
        "optimizer and precision settings for the 3.7M run are not verified.",
        "- *Fit*: predicted peak tensor bytes, sequence a multiple of 1024, micro-batch 1; ALST's "
        "figure is a run that trained, trainplan's a prediction not run on H100.",
    ]
