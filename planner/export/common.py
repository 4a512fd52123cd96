"""What every plan export shares: the exported file and its unexpressed decisions, AdamW's
constants, the schedule's phases and the decisions no framework config holds.

An export maps each of a plan's `Decisions` to the nearest native setting of one framework. A
decision the framework cannot express is a `NotExpressed`: the decision, the plan's value and
what the file uses instead; each export lists them in the file (as comments, or a key the
framework ignores) and `trainplan export` prints them on the terminal.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from trainplan.planner.plan import Decisions, Plan

ADAMW_BETAS = (0.9, 0.95)
"""AdamW's (beta1, beta2): the executor's `trainplan.executor.optimizers.BETAS` (planner cannot import the
executor; `tests/unit/planner/test_export.py` checks they agree)."""
ADAMW_WEIGHT_DECAY = 0.1
"""AdamW's decoupled weight decay: the executor's `trainplan.executor.optimizers.WEIGHT_DECAY`."""
ADAMW_EPS = 1e-8
"""AdamW's eps: torch.optim.AdamW's default, which the executor keeps."""
COOLDOWN_FRACTION = 0.2
"""The warmup-stable-decay schedule's cooldown: the last 20% of the planned steps
(`trainplan.executor.apply.applied.lr_at`)."""
COOLDOWN_FLOOR = 0.05
"""`trainplan.executor.apply.applied.lr_at` never goes below 5% of the peak during the cooldown."""
OPTIMIZER_STATE_BYTES = {32: 8.0, 16: 4.0, 8: 2.0, 4: 1.0}
"""Adam's two states, bytes per parameter, by `optimizer_bits` (`trainplan.costmodels.step.memory`)."""


@dataclass(frozen=True, slots=True)
class NotExpressed:
    """One decision of the plan a framework's config cannot express, and what it uses instead."""

    decision: str
    """The `Decisions` field (or `model`), e.g. `activation_checkpoint`."""
    planned: str
    """The plan's value, as the plan file writes it."""
    instead: str
    """What the framework lacks and what the exported file uses instead."""
    runs: dict[str, Any] = field(default_factory=dict)
    """The layout decisions (`trainplan.planner.plan.LAYOUT_FIELDS`) the file runs instead of the
    plan's, as `Decisions` values (e.g. {"optimizer_bits": 32}): what
    `trainplan.planner.export.repricing` re-prices the memory with; {} when the substitute
    costs no memory (a schedule, a seed) or cannot be priced by trainplan's cost models."""

    def line(self) -> str:
        """`decision = planned: instead`, one line."""
        return f"{self.decision} = {self.planned}: {self.instead}"


@dataclass(frozen=True, slots=True)
class Export:
    """A plan exported to one framework: the file's text and what it could not express."""

    target: str
    """`torchtitan`, `deepspeed` or `accelerate`."""
    kind: str
    """What the file is, e.g. `torchtitan job TOML (--job.config_file)`."""
    text: str
    """The whole file, ending in a newline."""
    not_expressed: tuple[NotExpressed, ...]

    @property
    def runs(self) -> dict[str, Any]:
        """The layout decisions the file runs instead of the plan's: every `NotExpressed.runs`
        merged, in order (a later one wins)."""
        out: dict[str, Any] = {}
        for n in self.not_expressed:
            out.update(n.runs)
        return out


@dataclass(frozen=True, slots=True)
class Schedule:
    """The plan's warmup-stable-decay learning rate (`trainplan.executor.apply.applied.lr_at`), in optimizer steps:
    step t < warmup_steps: peak x (t + 1) / warmup_steps; then the peak until
    total_steps - cooldown_steps; then peak x max(0.05, (total_steps - t) / cooldown_steps)."""

    peak_lr: float
    warmup_steps: int
    cooldown_steps: int
    total_steps: int


def schedule(d: Decisions) -> Schedule:
    """The schedule `trainplan.executor.apply.applied.lr_at` runs for decisions `d` (cooldown: max(1, int(0.2 x
    max_steps)) steps)."""
    return Schedule(peak_lr=d.lr, warmup_steps=d.warmup_steps,
                    cooldown_steps=max(1, int(COOLDOWN_FRACTION * d.max_steps)), total_steps=d.max_steps)


def checkpoint_summary(d: Decisions) -> str:
    """The per-block checkpoint entries, run-length style: `full x 30, none x 2` in block order
    of first appearance; a solved entry with the op count it keeps (`remat:3 (keeps 7 ops)`)."""
    counts = Counter(d.activation_checkpoint)
    parts = []
    for name in dict.fromkeys(d.activation_checkpoint):
        kept = f" (keeps {len(d.checkpoint_sets[name])} ops)" if name in d.checkpoint_sets else ""
        parts.append(f"{name}{kept} x {counts[name]}")
    return ", ".join(parts)


def every_nth_full(d: Decisions) -> int | None:
    """n when the blocks checkpointed are exactly blocks n-1, 2n-1, ... (0-based) and the others
    are `none`: every n-th block fully checkpointed (n = 1: all of them); None otherwise or
    when no block is checkpointed."""
    entries = d.activation_checkpoint
    if not entries or set(entries) - {"full", "none"} or "full" not in entries:
        return None
    first = entries.index("full") + 1
    expected = tuple("full" if (i + 1) % first == 0 else "none" for i in range(len(entries)))
    return first if expected == entries else None


def data_and_stop(d: Decisions, framework: str) -> list[NotExpressed]:
    """The decisions no framework config holds: the data subset (`data_fraction` < 1 or a
    scoring method), dynamic selection, the compute governor and compressed saved activations;
    each with what `framework`'s run does instead."""
    out = []
    if d.data_fraction < 1.0 or d.data_method != "random":
        out.append(NotExpressed(
            "data_fraction", f"{d.data_fraction:g} ({d.data_method})",
            f"{framework} reads the whole dataset; select the kept windows beforehand "
            "(`trainplan.executor.data.selection`) and point the data path at that subset"))
    if d.selection_every_steps:
        out.append(NotExpressed(
            "selection_every_steps", str(d.selection_every_steps),
            f"{framework} has no data re-scoring during training; the subset stays as loaded"))
    if d.governor_threshold > 0:
        out.append(NotExpressed(
            "governor_threshold", f"{d.governor_threshold:g}",
            f"{framework} has no loss-value stopping rule; the run trains all max_steps={d.max_steps} steps"))
    if d.activation_bits < 32:
        out.append(NotExpressed(
            "activation_bits", str(d.activation_bits),
            f"{framework} has no saved-activation compression; activations are saved as computed "
            "(more activation memory than the plan predicts)", runs={"activation_bits": 32}))
    for knob, tiled, what in (("loss_chunks", d.loss_chunks > 1, "a tiled LM head and loss"),
                              ("mlp_chunks", d.mlp_chunks > 1, "a tiled MLP")):
        if tiled:
            out.append(NotExpressed(knob, str(getattr(d, knob)), f"{framework} has no {what} "
                                    "(trainplan.modeling.tiling); used one chunk: more activation memory",
                                    runs={knob: 1}))
    if d.offload:
        out.append(NotExpressed("offload", "true", f"{framework} keeps checkpointed blocks' inputs on the device "
                                "(no trainplan.modeling.offload): more device memory", runs={"offload": False}))
    return out


def optimizer_bits_note(d: Decisions, framework: str, used: str) -> NotExpressed | None:
    """The note for an 8- or 4-bit Adam a framework's config cannot name (`used`: the optimizer
    the file names instead); None for 32 and 16 bits."""
    if d.optimizer_bits not in (8, 4):
        return None
    states = 16 if d.precision == "bf16" else 32  # torch's AdamW keeps its states in the parameters' dtype
    times = OPTIMIZER_STATE_BYTES[states] / OPTIMIZER_STATE_BYTES[d.optimizer_bits]
    library = "bitsandbytes AdamW8bit" if d.optimizer_bits == 8 else "torchao AdamW4bit"
    return NotExpressed("optimizer_bits", str(d.optimizer_bits),
                        f"{framework}'s config names no {d.optimizer_bits}-bit Adam ({library}); used {used} "
                        f"with {'bf16' if states == 16 else 'fp32'} states, {times:g}x the plan's "
                        "optimizer-state memory", runs={"optimizer_bits": states})


def header(plan: Plan, target: str) -> list[str]:
    """Comment lines (without the comment marker) that open every exported file: the plan it
    came from and the prediction it was made for."""
    d, p = plan.decisions, plan.predictions
    gib = p.memory_bytes.get("total", 0.0) / 2**30
    return [f"trainplan export --to {target}: {plan.model} on {d.devices} x {plan.hw}, "
            f"seq_len {d.seq_len}, {d.max_steps} steps ({d.max_tokens:,} tokens)",
            f"decisions: dp {d.dp_degree} x sp {d.sp_degree}, zero_stage {d.zero_stage}, micro_batch "
            f"{d.micro_batch} x grad_accum {d.grad_accum}, {d.precision}, optimizer_bits {d.optimizer_bits}, "
            f"checkpoint {checkpoint_summary(d)}",
            f"predicted: {gib:.2f} GiB per device, {p.step_time_s:.4g} s per step, loss {p.final_loss:.3f}"]


def not_expressed_lines(notes: tuple[NotExpressed, ...] | list[NotExpressed], target: str) -> list[str]:
    """The unexpressed decisions as lines (without a comment marker); one line saying so when
    there are none."""
    if not notes:
        return [f"every decision of the plan is expressed in this {target} config"]
    return [f"not expressible in {target} ({len(notes)}), and what is used instead:",
            *(f"- {n.line()}" for n in notes)]
