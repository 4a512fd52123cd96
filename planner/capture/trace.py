"""Tracing one region of a model: a `make_fx` trace of its forward+backward on fake tensors,
summarised as a `trainplan.costmodels.graph.Region` (op graph in networkx, storages with lifetimes, sizes
as polynomials in micro-batch `b` and sequence `s`). `trainplan.planner.capture.graph` decides the regions."""

from __future__ import annotations

import contextlib

import networkx as nx
import sympy
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.multiprocessing.reductions import StorageWeakRef

from trainplan.costmodels.graph import Poly, Region, StorageRecord
from trainplan.modeling.activation_compression import compress_saved_activations
from trainplan.modeling.flop_counting import FLOP_FORMULAS as _FLOP_FORMULAS
from trainplan.planner.capture.device_kernels import target_kernels

B_SYM, S_SYM = sympy.symbols("b s", positive=True, integer=True)



def _power(d: int, p: int) -> tuple[int, int]:
    """(k, d / p**k) with p**k the largest power of `p` dividing `d`."""
    k = 0
    while d and d % p == 0:
        d //= p
        k += 1
    return k, d


def _symbolize(shape: tuple[int, ...], b0: int, s0: int, chunks: int = 1):
    """Symbolic shape and numel of `shape` traced at micro-batch `b0`, sequence `s0`.

    `b0` and `s0 / chunks` are primes that divide no model dimension (`trainplan.planner.capture.graph`
    picks them so), so a dimension's factors of them are exactly its dependence on the batch
    and the sequence: d = b0**i * (s0/chunks)**j * c is `b**i * (s/chunks)**j * c`, whatever
    the product (b*s tokens, b*heads in an eager attention's bmm, b*s*top_k routed rows, s*s
    scores). `chunks` > 1: a sequence-tiled trace, whose tile is `s/chunks`."""
    expr = sympy.Integer(1)
    sym_shape = []
    tile = s0 // chunks
    for d in shape:
        d = int(d)
        i, rest = _power(d, b0)
        j, c = _power(rest, tile)
        e = B_SYM**i * (S_SYM / chunks)**j * c if d else sympy.Integer(0)
        sym_shape.append(e)
        expr = expr * e
    return tuple(sym_shape), expr


def _sym_args(x, b0, s0, chunks=1):
    if isinstance(x, torch.Tensor):
        return _symbolize(tuple(x.shape), b0, s0, chunks)[0]
    if isinstance(x, (list, tuple)):
        return type(x)(_sym_args(v, b0, s0, chunks) for v in x)
    return x


def _flops(node, b0, s0, chunks=1):
    packet = getattr(node.target, "overloadpacket", None)
    if packet not in _FLOP_FORMULAS:
        return sympy.Integer(0)
    args = [_sym_args(a.meta.get("val") if isinstance(a, torch.fx.Node) else a, b0, s0, chunks)
            for a in node.args]
    kwargs = {k: _sym_args(v.meta.get("val") if isinstance(v, torch.fx.Node) else v, b0, s0, chunks)
              for k, v in node.kwargs.items()}
    out = _sym_args(node.meta.get("val"), b0, s0, chunks)
    return sympy.expand(_FLOP_FORMULAS[packet](*args, out_val=out, **kwargs))


def _tensors(val):
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [t for v in val for t in _tensors(v)]
    return []


def trace_region(name: str, fn, inputs: dict, *, kinds: dict[str, str], b0: int, s0: int,
                 block: int | None, autocast_dtype: torch.dtype | None = None,
                 activation_bits: int = 32, held_to_output: tuple[str, ...] = (),
                 held: list | None = None, device_type: str = "cpu", chunks: int = 1,
                 keep_from: tuple[str, ...] = ()) -> Region:
    """Trace `fn(**inputs)` and summarise it as a Region. `fn` returns
    (forward_output, [parameter gradients], [other outputs]).

    `kinds` maps each input name to "param", "act" (activation input, e.g. hidden states),
    "grad" (the incoming gradient) or "const" (e.g. token ids). `activation_bits` < 32 traces
    under the executor's saved-activation compression (`trainplan.modeling.activation_compression`):
    its quantize and dequantize ops and compressed copies become part of the region.
    `held_to_output`: ops (e.g. `aten._log_softmax.default`) whose inputs stay referenced until
    the forward output is made, as the arguments of a composite op the trace decomposes do
    (`F.cross_entropy` holds the logits until it returns). `held`: a list `fn` appends tensors
    to that its Python frame keeps until the forward output is made (the logits `lm_loss`
    receives, bf16 under autocast, beside the fp32 copy cross-entropy makes of them).
    `device_type`: trace attention and dropout as that device runs them
    (`trainplan.planner.capture.device_kernels.target_kernels`). `chunks` > 1: `fn` tiles the sequence
    into that many chunks (`trainplan.modeling.tiling`) and `s0` is a multiple of it; a chunk's dimensions
    become `s/chunks` (`_symbolize`). `keep_from`: input names; when given, the region is the
    ops that depend on them and the ops those depend on, and the rest of the trace is left out
    (the tail's trace runs the model's whole forward and keeps what follows the last block).
    Inputs no kept op reads are left out."""
    names = list(inputs)
    param_ids = frozenset(id(inputs[n]) for n in names if kinds[n] == "param")
    compression = []

    def run(*a):
        ctx = compress_saved_activations(activation_bits, param_ids | frozenset(
            id(x) for x, n in zip(a, names, strict=False) if kinds[n] == "param"), record=True)
        compression.append(ctx)
        with ctx, target_kernels(device_type), (
                torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None
                else contextlib.nullcontext()):
            return fn(**dict(zip(names, a, strict=False)))

    gm = make_fx(run, tracing_mode="real")(
        *[inputs[n] for n in names])
    all_nodes = list(gm.graph.nodes)
    out_node = all_nodes[-1]
    fwd_out, param_grads, _ = out_node.args[0]
    order = {n: i for i, n in enumerate(all_nodes)}
    kept = _kept(all_nodes, [p for p, nm in zip(all_nodes, names, strict=False) if nm in keep_from]) \
        if keep_from else set(all_nodes)
    nodes = [n for n in all_nodes if n in kept and (n.op != "placeholder" or kinds[names[order[n]]] in ("act", "grad")
                                                   or any(u in kept for u in n.users))]
    kept = set(nodes) | {out_node}
    grad_vals = [g.meta["val"] for g in param_grads if isinstance(g, torch.fx.Node)]
    # a weight gradient is a view (t) of an mm's output: its category goes with the storage
    grad_keys = {StorageWeakRef(v.untyped_storage()).cdata for v in grad_vals}
    copied = {StorageWeakRef(v.untyped_storage()).cdata for v in grad_vals if not v.is_contiguous()}
    boundary = order[fwd_out]
    placeholders = [n for n in all_nodes if n.op == "placeholder"]
    ph_kind = {p: kinds[nm] for p, nm in zip(placeholders, names, strict=False)}

    graph = nx.DiGraph(name=name)
    storages: dict[int, dict] = {}
    for n in nodes:
        if n.op == "output":
            continue
        phase = "fwd" if order[n] <= boundary else "bwd"
        for t in _tensors(n.meta.get("val")):
            key = StorageWeakRef(t.untyped_storage()).cdata
            if key in storages:
                continue
            _, numel_expr = _symbolize(tuple(t.shape), b0, s0, chunks)
            nbytes = t.untyped_storage().nbytes()
            numel_at = int(numel_expr.subs({B_SYM: b0, S_SYM: s0}))
            coef = sympy.Rational(nbytes, numel_at) if numel_at else sympy.Integer(nbytes)
            if n.op == "placeholder":
                category = "param" if ph_kind[n] == "param" else "input"
            elif key in grad_keys:
                category = "grad"
            else:
                category = "act" if phase == "fwd" else "temp"
            storages[key] = dict(creator=n.name, created=order[n], category=category,
                                 input_kind=ph_kind[n] if n.op == "placeholder" else "",
                                 bytes=sympy.expand(coef * numel_expr), uses=[order[n]],
                                 fwd_out=n is fwd_out, copied=key in copied)
        if n.op != "call_function":
            continue
        out_bytes = _nbytes(n.meta.get("val"), b0, s0, chunks)
        in_bytes = sum((_nbytes(a.meta.get("val"), b0, s0, chunks) for a in n.all_input_nodes),
                       sympy.Integer(0))
        graph.add_node(n.name, op=str(n.target), phase=phase, order=order[n], block=block,
                       out_bytes=to_poly(out_bytes), in_bytes=to_poly(in_bytes),
                       flops=to_poly(_flops(n, b0, s0, chunks)))
        for a in n.all_input_nodes:
            if a.op == "call_function" and a in kept:
                graph.add_edge(a.name, n.name)
    # last use of each storage: any node reading a tensor that lives in it
    reads: dict = {}
    for n in [*nodes, out_node]:
        for a in n.all_input_nodes:
            for t in _tensors(a.meta.get("val")):
                key = StorageWeakRef(t.untyped_storage()).cdata
                if key in storages:
                    storages[key]["uses"].append(order[n] if n.op != "output" else len(all_nodes))
                    reads.setdefault(n, set()).add(key)
    _hold_saved_to_node_end(nodes, order, boundary, storages, reads)
    held_tensors = [t for n in nodes if str(n.target) in held_to_output
                    for a in n.all_input_nodes for t in _tensors(a.meta.get("val"))] + list(held or ())
    for t in held_tensors:
        rec = storages.get(StorageWeakRef(t.untyped_storage()).cdata)
        if rec is not None:
            rec["uses"].append(boundary)
    # a compressed copy is held by its backward node (its saved variable) until the node is
    # done, i.e. until the node's last read of the tensor unpacked from it (not just the unpack)
    for ctx in compression:
        for packed, out in getattr(ctx, "unpacked", None) or ():
            end = storages.get(StorageWeakRef(out.untyped_storage()).cdata)
            for t in (packed.codes, packed.scale):
                rec = storages.get(StorageWeakRef(t.untyped_storage()).cdata) if t is not None else None
                if rec is not None and end is not None:
                    rec["uses"].append(max(end["uses"]))
    records = tuple(
        StorageRecord(creator=s["creator"], category=s["category"], input_kind=s["input_kind"],
                      bytes=to_poly(s["bytes"]), created=s["created"],
                      last_fwd_use=max([u for u in s["uses"] if u <= boundary], default=s["created"]),
                      last_use=max(s["uses"]), is_fwd_output=s["fwd_out"],
                      copied_on_accumulate=s["copied"])
        for s in storages.values())
    handed: list[Poly] = []
    seen_handed: set[int] = set()
    # what the head hands the blocks, kept by their saved tensors; with compressed saving the
    # blocks keep compressed copies (counted in their regions) and the originals die with the forward
    for other in out_node.args[0][2] if name.split("@")[0] == "head" and activation_bits == 32 else ():
        val = other.meta.get("val") if isinstance(other, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor):
            handed.append(())
            continue
        key = StorageWeakRef(val.untyped_storage()).cdata
        rec = storages.get(key)
        fresh = rec is not None and key not in seen_handed and rec["created"] > boundary
        handed.append(to_poly(rec["bytes"]) if rec is not None and fresh else ())
        seen_handed.add(key)
    return Region(name=name, graph=graph, storages=records, boundary=boundary, n_nodes=len(all_nodes),
                  handed=tuple(handed))


def _hold_saved_to_node_end(nodes: list, order: dict, boundary: int, storages: dict, reads: dict) -> None:
    """Keep each forward tensor an autograd node saved until that node's whole backward is done.

    The engine releases a node's saved tensors after the node's backward returns
    (`torch/csrc/autograd/saved_variable.h`, released on the node's `release_variables`), not
    after the op of it that last reads each one: `mul(a, b)`'s backward makes `g * b` and then
    `g * a`, and `b` is alive until the second. The trace has no node boundaries, so a node's
    backward is taken as the run of consecutive backward ops that read its incoming gradient `g`
    (ops that make no new storage, views, may sit between them): a forward tensor read with `g`
    lives to the run's end."""
    bwd = [n for n in nodes if n.op == "call_function" and order[n] > boundary]
    made = {n: {k for k, s in storages.items() if s["created"] == order[n]} for n in bwd}
    for i, n in enumerate(bwd):
        saved = {k for k in reads.get(n, ()) if storages[k]["created"] <= boundary
                 and storages[k]["category"] in ("act", "input") and storages[k]["input_kind"] != "grad"}
        grads = {k for k in reads.get(n, ()) if k not in saved and storages[k]["category"] in ("temp", "input")}
        if not saved or not grads:
            continue
        end = order[n]
        for m in bwd[i + 1:]:
            if reads.get(m, set()) & grads:
                end = order[m]
            elif made[m]:
                break
        for k in saved:
            storages[k]["uses"].append(end)


def _kept(nodes: list, roots: list) -> set:
    """The nodes that depend on `roots` and every node those depend on."""
    reach: set = set()
    todo = list(roots)
    while todo:
        n = todo.pop()
        if n not in reach:
            reach.add(n)
            todo.extend(n.users)
    kept = set(reach)
    todo = [a for n in reach for a in n.all_input_nodes]
    while todo:
        n = todo.pop()
        if n not in kept:
            kept.add(n)
            todo.extend(n.all_input_nodes)
    return kept



def to_poly(expr) -> Poly:
    """A sympy polynomial in (b, s) as Poly terms."""
    expr = sympy.expand(expr)
    if expr == 0:
        return ()
    poly = sympy.Poly(expr, B_SYM, S_SYM)
    return tuple((int(i), int(j), float(c)) for (i, j), c in poly.terms())


def _nbytes(val, b0, s0, chunks=1):
    return sum((_symbolize(tuple(t.shape), b0, s0, chunks)[1] * t.element_size() for t in _tensors(val)),
               sympy.Integer(0))
