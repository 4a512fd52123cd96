"""The captured graph as the cost models see it: regions of ops with symbolic sizes.

Sizes are polynomials in the micro-batch `b` and the per-rank sequence length `s`, stored as
`Poly = ((i, j, coef), ...)` meaning sum(coef * b**i * s**j): bytes of a tensor, FLOPs of an op.
`trainplan.planner.capture.graph` builds these from a `make_fx` trace; here they are plain data, so the cost
models stay free of torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

Poly = tuple[tuple[int, int, float], ...]
"""sum(coef * b**i * s**j) over the terms; b = micro-batch, s = sequence length per rank."""


def variant_key(region: str, *, mixed_precision: bool = False, activation_bits: int = 32,
                chunks: int = 1) -> str:
    """The key of `region` traced with these settings: `{region}[@mp][@m{k}|@l{k}][@a{bits}]`,
    parsed back by `trainplan.planner.capture.regions.parse_key`. `mixed_precision`: under FSDP2's
    mixed-precision policy; `chunks` > 1: a block's MLP (`@m{k}`) or the tail's LM head and loss
    (`@l{k}`) over that many sequence chunks; `activation_bits` < 32: saved activations compressed."""
    key = region + ("@mp" if mixed_precision else "")
    if chunks > 1:
        key += f"@{'l' if region == 'tail' else 'm'}{chunks}"
    return key if activation_bits == 32 else f"{key}@a{activation_bits}"


def poly_at(p: Poly, b: float, s: float) -> float:
    """Evaluate a Poly at micro-batch `b` and sequence length `s`."""
    return sum(c * b**i * s**j for i, j, c in p)


@dataclass(frozen=True, kw_only=True, slots=True)
class StorageRecord:
    """One tensor storage of a traced region (views share their base's storage)."""

    creator: str
    """FX node that first produced it (a placeholder for inputs)."""
    category: str
    """`param`, `input` (activation or gradient handed in), `act` (made in forward), `temp`
    (made in backward), `grad` (a parameter's gradient)."""
    input_kind: str
    """For inputs: `act` (hidden states, owned here), `shared` (e.g. rotary cos/sin, owned by
    the head), `grad` (incoming gradient), `const` (token ids); empty otherwise."""
    bytes: Poly
    created: int
    """Execution index of the creating node."""
    last_fwd_use: int
    """Execution index of the last forward node that reads it."""
    last_use: int
    """Execution index of the last node that reads it; `Region.n_nodes` means it outlives the
    region (a region output)."""
    is_fwd_output: bool = False
    """The region's forward output (handed to the next region, which accounts for it)."""
    copied_on_accumulate: bool = False
    """A parameter gradient whose layout differs from its parameter's (a linear weight's grad
    is `t(mm(...))`): autograd's AccumulateGrad stores a contiguous copy in `.grad`, so for a
    moment both exist (`torch/csrc/autograd/functions/accumulate_grad.h`, the layout contract)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Region:
    """A traced forward+backward region: the head, one transformer block, or the tail.

    `graph` is the op graph (networkx DiGraph) whose nodes carry `op`, `phase` ("fwd"/"bwd"),
    `order`, `out_bytes`, `in_bytes` and `flops` (Polys). `boundary` is the execution index of
    the forward output: nodes at or before it are forward."""

    name: str
    graph: nx.DiGraph
    storages: tuple[StorageRecord, ...]
    boundary: int
    n_nodes: int
    handed: tuple[Poly, ...] = ()
    """The head: bytes of each tensor it hands the blocks besides the hidden states (rotary
    tables, masks, position ids), in `trainplan.planner.capture.layout`'s order; 0 for one whose storage
    an earlier one shares or the forward retains anyway."""
    recompute_to_end: bool = False
    """Checkpointed, the whole forward is recomputed (the executor turns torch's early stop off):
    a block whose MLP is tiled (`trainplan.modeling.tiling`), whose chunk checkpoints save their inputs as
    the block's forward runs, so an early stop would fall inside the last chunk, at a point the
    trace does not show (`trainplan.executor.apply.checkpointing.apply_checkpointing`, `early_stop`)."""

    def fwd_nodes(self) -> list[str]:
        """Forward op nodes in execution order."""
        g = self.graph
        return sorted((n for n in g if g.nodes[n]["phase"] == "fwd"), key=lambda n: g.nodes[n]["order"])

    def bwd_nodes(self) -> list[str]:
        """Backward op nodes in execution order."""
        g = self.graph
        return sorted((n for n in g if g.nodes[n]["phase"] == "bwd"), key=lambda n: g.nodes[n]["order"])

    def recompute_horizon(self) -> int:
        """Execution index of the last forward op whose output backward reads. A non-reentrant
        checkpoint stops recomputing there (torch.utils.checkpoint's early stop), so later
        forward ops are never recomputed. With `recompute_to_end`, the forward output's index:
        the whole forward is recomputed."""
        if self.recompute_to_end:
            return self.boundary
        return max((r.created for r in self.storages
                    if r.category == "act" and r.last_use > self.boundary
                    and not r.is_fwd_output), default=-1)

    def param_grad_bytes(self, b: float, s: float) -> float:
        """Bytes of the parameter gradients this region produces."""
        return sum(poly_at(r.bytes, b, s) for r in self.storages if r.category == "grad")

    def param_bytes(self) -> float:
        """Bytes of this region's parameters at the capture dtype."""
        return sum(poly_at(r.bytes, 1, 1) for r in self.storages if r.category == "param")
