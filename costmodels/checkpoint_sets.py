"""Activation-checkpoint sets: which forward ops of a transformer block keep their outputs.

A `CheckpointSet` is data: a name and the saved node keys (or op names). Under torch's
selective activation checkpointing (`torch.utils.checkpoint.create_selective_checkpoint_contexts`)
the policy function answers MUST_SAVE for those ops and MUST_RECOMPUTE for every other op;
the other ops are recomputed at the start of the block's backward. `saved=None` means no
checkpointing at all (plain autograd).

A node key names one op of the block's forward as the SAC policy function can name it at run
time: `"<ATen overload>#<k>"`, the k-th call (from 0) of that overload in one forward of the
block, e.g. `"aten.mm.default#3"`. torch counts calls per overload the same way
(`_CachingTorchDispatchMode.func_counter`); `aten.detach` is skipped by torch
(`SAC_IGNORED_OPS`) and `getitem` is not an op, so neither is counted. Attention overloads differ
by device (`_scaled_dot_product_flash_attention_for_cpu` on CPU, `_flash_attention` or
`_efficient_attention` on CUDA/ROCm) and are all counted as `attention`, so a key found on the
CPU capture names the same call on a GPU. An entry of `saved` without `#` is an op name and
matches every call of that op (the rule-based entries below).

Built-in entries:

- `none`: no checkpointing, plain autograd.
- `full`: checkpoint the whole block, keep only its inputs (Chen et al. 2016).
- `save_matmuls`: keep matmul and attention outputs, recompute elementwise ops and norms
  (the op-level SAC list of torchtitan, `_save_list`).
- `save_attention`: keep only attention outputs, recompute everything else: AutoSP's rule
  (sequence-aware checkpointing: at long sequence attention dominates compute).

Solved entries (`remat:k`, `trainplan.planner.joint.remat_solver`) are sets of node keys, chosen per block
shape by a CP-SAT model; a Plan carries their keys (`Decisions.checkpoint_sets`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from trainplan.costmodels.graph import Region
from trainplan.errors import TrainplanError

ATTENTION_OPS = frozenset({
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
})
ATTENTION = "attention"
"""The op name every attention overload is counted under in node keys."""
MATMUL_OPS = frozenset({"aten.mm.default", "aten.addmm.default", "aten.bmm.default"})
UNCOUNTED_OPS = frozenset({"aten.detach.default", "<built-in function getitem>"})
"""Forward nodes the SAC policy function never sees (torch's SAC_IGNORED_OPS; getitem is
Python indexing of a multi-output op, not a dispatched op)."""


def canonical_op(op: str) -> str:
    """The name an op is counted under in node keys (attention overloads share one)."""
    return ATTENTION if op in ATTENTION_OPS else op


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointSet:
    """One checkpoint menu entry: what a checkpointed block keeps.

    Hashable (a cache key of the cost models); two entries are the same when name and saved
    set are."""

    name: str
    saved: frozenset[str] | None
    """Node keys (`"aten.mm.default#3"`) or op names (`"aten.mm.default"`, `"attention"`)
    whose outputs are kept; None: the block is not checkpointed."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"CheckpointSet.name={self.name!r} must be a non-empty string")
        if self.saved is not None:
            object.__setattr__(self, "saved", frozenset(canonical_op(k) for k in self.saved))

    @property
    def checkpointed(self) -> bool:
        """Whether the block runs under a checkpoint at all."""
        return self.saved is not None

    def saves(self, key: str) -> bool:
        """Whether the op call with node key `key` keeps its output."""
        if self.saved is None:
            return True
        return key in self.saved or key.split("#", 1)[0] in self.saved


BUILTIN: dict[str, CheckpointSet] = {
    "none": CheckpointSet(name="none", saved=None),
    "full": CheckpointSet(name="full", saved=frozenset()),
    "save_matmuls": CheckpointSet(name="save_matmuls", saved=MATMUL_OPS | {ATTENTION}),
    "save_attention": CheckpointSet(name="save_attention", saved=frozenset({ATTENTION})),
}
POLICIES: dict[str, frozenset[str] | None] = {k: v.saved for k, v in BUILTIN.items()}
"""Built-in entries by name: saved op names, None for no checkpointing (kept for callers that
predate `CheckpointSet`)."""
AUTOSP = "save_attention"
"""AutoSP's rule, the sequence-aware baseline."""
MENU = "remat"
"""In a search space's policies: add each block shape's solved Pareto menu (`remat:k` entries,
`trainplan.planner.joint.remat_solver.pareto_menu`) to the named entries."""


def sets_from_mapping(sets: Mapping[str, Iterable[str]] | None) -> dict[str, CheckpointSet]:
    """Solved entries as a Plan stores them (`Decisions.checkpoint_sets`: name -> saved keys)."""
    return {name: CheckpointSet(name=name, saved=frozenset(keys)) for name, keys in (sets or {}).items()}


def resolve(name: str | CheckpointSet, sets: Mapping[str, CheckpointSet] | None = None) -> CheckpointSet:
    """The entry `name` refers to: itself if already a CheckpointSet, else `sets[name]` or a
    built-in entry.

    Raises:
        TrainplanError: unknown name; the message lists the known ones.
    """
    if isinstance(name, CheckpointSet):
        return name
    if sets and name in sets:
        return sets[name]
    if name in BUILTIN:
        return BUILTIN[name]
    known = list(BUILTIN) + sorted(sets or {})
    raise TrainplanError(f"unknown checkpoint policy {name!r}: known policies are {', '.join(known)}"
                         + ("" if sets else "; a solved entry (remat:k) needs the plan's "
                            "checkpoint_sets"))


def check_policy(name: str, sets: Mapping[str, CheckpointSet] | None = None) -> str:
    """Return `name` if it names a known entry (built-in or in `sets`).

    Raises:
        TrainplanError: unknown policy; the message lists the known ones.
    """
    resolve(name, sets)
    return name


def is_checkpointed(name: str | CheckpointSet, sets: Mapping[str, CheckpointSet] | None = None) -> bool:
    """Whether the entry wraps the block in a checkpoint at all."""
    return resolve(name, sets).checkpointed


def op_is_saved(name: str, op: str) -> bool:
    """Whether built-in policy `name` keeps every output of ATen op `op` (`aten.mm.default`)."""
    return resolve(name).saves(canonical_op(op))


def node_keys(region: Region) -> dict[str, str]:
    """Forward node name -> node key, in execution order (uncounted nodes left out). Cached in
    the region's graph attributes (`graph.graph["node_keys"]`)."""
    g = region.graph
    if "node_keys" in g.graph:
        return g.graph["node_keys"]
    counts: dict[str, int] = {}
    keys: dict[str, str] = {}
    for n in region.fwd_nodes():
        op = g.nodes[n]["op"]
        if op in UNCOUNTED_OPS:
            continue
        op = canonical_op(op)
        keys[n] = f"{op}#{counts.get(op, 0)}"
        counts[op] = counts.get(op, 0) + 1
    g.graph["node_keys"] = keys
    return keys


def saved_nodes(region: Region, entry: CheckpointSet) -> frozenset[str]:
    """Forward nodes of `region` whose outputs `entry` keeps (empty when not checkpointed)."""
    if not entry.checkpointed:
        return frozenset()
    return frozenset(n for n, k in node_keys(region).items() if entry.saves(k))


def keys_of(region: Region, nodes: Iterable[str]) -> frozenset[str]:
    """Node keys of forward nodes `nodes` of `region`."""
    keys = node_keys(region)
    return frozenset(keys[n] for n in nodes)


class KeyCounter:
    """Names op calls by node key as they run: `key(op)` for each dispatched op of one forward
    of a block, in order (the run-time side of `node_keys`)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def key(self, op: str) -> str:
        op = canonical_op(op)
        k = self.counts.get(op, 0)
        self.counts[op] = k + 1
        return f"{op}#{k}"
