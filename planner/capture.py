"""Graph capture: the op-level forward+backward graph of a model, on fake tensors.

What the planner reasons over must be what runs. Selective activation checkpointing's policy
sees ops *below* autograd (`aten.mm`, `aten._scaled_dot_product_flash_attention_for_cpu`, ...),
so each region is traced with `make_fx` over a function that runs forward and backward
(`torch.func.functional_call` + `torch.autograd.grad`) under `FakeTensorMode`: no memory is
allocated, so a 405B model captures on a laptop. A region is one piece of a causal LM:

- `head`: token embedding and rotary position embedding;
- `block`: one transformer layer (identical layers are detected by parameter signature and
  traced once);
- `tail`: final norm, LM head and the cross-entropy loss (`lm_loss`, which the executor uses too).

Shapes are made symbolic by tracing at sentinel sizes (micro-batch `B0`, sequence `S0`, primes
that no model dimension equals): every tensor dimension equal to B0, S0 or B0*S0 becomes `b`,
`s` or `b*s`, so bytes and FLOPs of every node are polynomials in (b, s), evaluated by the cost
models for any micro-batch and sequence length. FLOPs per node use torch's own formulas
(`torch.utils.flop_counter.flop_registry`), the same that `FlopCounterMode` applies at run time.

The trace runs with fake *CPU* tensors, so attention appears as
`_scaled_dot_product_flash_attention_for_cpu`; its saved tensors (q, k, v, out, logsumexp) are
those of the CUDA flash kernel, so the memory model carries over to GPUs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import networkx as nx
import sympy
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import flop_counter

from costmodels.graph import Poly, Region, StorageRecord
from hardware_profiles.errors import TrainplanError

B_SYM, S_SYM = sympy.symbols("b s", positive=True, integer=True)
_SENTINELS = [(7, 113), (11, 127), (13, 131), (5, 139)]

# FlopCounterMode counts CUDA flash attention but not the CPU kernel; give the CPU ops torch's
# own SDPA formulas so that predicted and measured FLOPs follow one convention (full s^2, the
# causal mask not subtracted; the backward counts 2.5x the forward's matmuls, as torch does).
CPU_ATTENTION_FLOP_FORMULAS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        flop_counter.shape_wrapper(
            lambda q, k, v, *args, out_shape=None, **kw: flop_counter.sdpa_flop_count(q, k, v)),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        flop_counter.shape_wrapper(
            lambda g, q, k, v, *args, out_shape=None, **kw:
            flop_counter.sdpa_backward_flop_count(g, q, k, v)),
}
for _f in CPU_ATTENTION_FLOP_FORMULAS.values():
    _f._get_raw = True
_FLOP_FORMULAS = {**flop_counter.flop_registry, **CPU_ATTENTION_FLOP_FORMULAS}


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, nats. logits (b, s, V), labels (b, s) already shifted."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelGraph:
    """What the cost models know of a model: its regions, in execution order.

    `blocks[i]` names the region (a key of `regions`) that transformer layer i runs; identical
    layers share one region. Each region also carries its op graph as a networkx DiGraph
    (`Region.graph`): nodes are FX node names with attributes `op`, `phase` ("fwd"/"bwd"),
    `order`, `block`, `out_bytes` and `flops` (sympy polynomials in b, s)."""

    name: str
    n_params: int
    param_bytes: int
    """Bytes of the parameters at the capture dtype."""
    regions: dict[str, Region]
    blocks: tuple[str, ...]
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    n_layers: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "n_layers", len(self.blocks))

    @property
    def distinct_blocks(self) -> dict[str, int]:
        """Region name -> how many layers run it."""
        out: dict[str, int] = {}
        for b in self.blocks:
            out[b] = out.get(b, 0) + 1
        return out


def _symbolize(shape: tuple[int, ...], b0: int, s0: int):
    expr = sympy.Integer(1)
    sym_shape = []
    for d in shape:
        d = int(d)
        if d == b0 * s0:
            e = B_SYM * S_SYM
        elif d == s0:
            e = S_SYM
        elif d == b0:
            e = B_SYM
        else:
            e = sympy.Integer(d)
        sym_shape.append(e)
        expr = expr * e
    return tuple(sym_shape), expr


def _sym_args(x, b0, s0):
    if isinstance(x, torch.Tensor):
        return _symbolize(tuple(x.shape), b0, s0)[0]
    if isinstance(x, (list, tuple)):
        return type(x)(_sym_args(v, b0, s0) for v in x)
    return x


def _flops(node, b0, s0):
    packet = getattr(node.target, "overloadpacket", None)
    if packet not in _FLOP_FORMULAS:
        return sympy.Integer(0)
    args = [_sym_args(a.meta.get("val") if isinstance(a, torch.fx.Node) else a, b0, s0)
            for a in node.args]
    kwargs = {k: _sym_args(v.meta.get("val") if isinstance(v, torch.fx.Node) else v, b0, s0)
              for k, v in node.kwargs.items()}
    out = _sym_args(node.meta.get("val"), b0, s0)
    return sympy.expand(_FLOP_FORMULAS[packet](*args, out_val=out, **kwargs))


def _tensors(val):
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [t for v in val for t in _tensors(v)]
    return []


def trace_region(name: str, fn, inputs: dict, *, kinds: dict[str, str], b0: int, s0: int,
                 block: int | None, autocast_dtype: torch.dtype | None = None) -> Region:
    """Trace `fn(**inputs)` and summarise it as a Region. `fn` returns
    (forward_output, [parameter gradients], [other outputs]).

    `kinds` maps each input name to "param", "act" (activation input, e.g. hidden states),
    "grad" (the incoming gradient) or "const" (e.g. token ids)."""
    names = list(inputs)
    def run(*a):
        if autocast_dtype is None:
            return fn(**dict(zip(names, a)))
        with torch.autocast("cpu", dtype=autocast_dtype):
            return fn(**dict(zip(names, a)))

    gm = make_fx(run, tracing_mode="real")(
        *[inputs[n] for n in names])
    nodes = list(gm.graph.nodes)
    out_node = nodes[-1]
    fwd_out, param_grads, _ = out_node.args[0]
    grad_vals = [g.meta["val"] for g in param_grads if isinstance(g, torch.fx.Node)]
    # a weight gradient is a view (t) of an mm's output: its category goes with the storage
    grad_keys = {StorageWeakRef(v.untyped_storage()).cdata for v in grad_vals}
    copied = {StorageWeakRef(v.untyped_storage()).cdata for v in grad_vals if not v.is_contiguous()}
    order = {n: i for i, n in enumerate(nodes)}
    boundary = order[fwd_out]
    placeholders = [n for n in nodes if n.op == "placeholder"]
    ph_kind = {p: kinds[nm] for p, nm in zip(placeholders, names)}

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
            _, numel_expr = _symbolize(tuple(t.shape), b0, s0)
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
        out_bytes = _nbytes(n.meta.get("val"), b0, s0)
        in_bytes = sum((_nbytes(a.meta.get("val"), b0, s0) for a in n.all_input_nodes),
                       sympy.Integer(0))
        graph.add_node(n.name, op=str(n.target), phase=phase, order=order[n], block=block,
                       out_bytes=to_poly(out_bytes), in_bytes=to_poly(in_bytes),
                       flops=to_poly(_flops(n, b0, s0)))
        for a in n.all_input_nodes:
            if a.op == "call_function":
                graph.add_edge(a.name, n.name)
    # last use of each storage: any node reading a tensor that lives in it
    for n in nodes:
        for a in n.all_input_nodes:
            for t in _tensors(a.meta.get("val")):
                key = StorageWeakRef(t.untyped_storage()).cdata
                if key in storages:
                    storages[key]["uses"].append(order[n] if n.op != "output" else len(nodes))
    records = tuple(
        StorageRecord(creator=s["creator"], category=s["category"], input_kind=s["input_kind"],
                      bytes=to_poly(s["bytes"]), created=s["created"],
                      last_fwd_use=max([u for u in s["uses"] if u <= boundary], default=s["created"]),
                      last_use=max(s["uses"]), is_fwd_output=s["fwd_out"],
                      copied_on_accumulate=s["copied"])
        for s in storages.values())
    return Region(name=name, graph=graph, storages=records, boundary=boundary, n_nodes=len(nodes))


def to_poly(expr) -> Poly:
    """A sympy polynomial in (b, s) as Poly terms."""
    expr = sympy.expand(expr)
    if expr == 0:
        return ()
    poly = sympy.Poly(expr, B_SYM, S_SYM)
    return tuple((int(i), int(j), float(c)) for (i, j), c in poly.terms())


def _nbytes(val, b0, s0):
    return sum((_symbolize(tuple(t.shape), b0, s0)[1] * t.element_size() for t in _tensors(val)),
               sympy.Integer(0))


def _pick_sentinels(model: nn.Module) -> tuple[int, int]:
    dims = {int(d) for p in model.parameters() for d in p.shape}
    cfg = getattr(model, "config", None)
    if cfg is not None:
        dims |= {int(v) for v in vars(cfg).values() if isinstance(v, int) and not isinstance(v, bool)}
    for b0, s0 in _SENTINELS:
        if not dims & {b0, s0, b0 * s0}:
            return b0, s0
    raise TrainplanError("model dimensions collide with every capture sentinel size")


def _fake_params(module: nn.Module, mode: FakeTensorMode, dtype: torch.dtype | None) -> dict:
    with mode:
        return {k: torch.empty(v.shape, dtype=dtype or v.dtype, device="cpu", requires_grad=True)
                for k, v in module.named_parameters()}


def _block_signature(block: nn.Module) -> tuple:
    return (type(block).__name__,) + tuple((k, tuple(v.shape), str(v.dtype))
                                           for k, v in block.named_parameters())


def capture(model: nn.Module, *, dtype: torch.dtype | None = None, name: str | None = None,
            autocast_dtype: torch.dtype | None = None) -> ModelGraph:
    """Capture `model` (a HF-style causal LM: `.model.embed_tokens`, `.model.layers`,
    `.model.norm`, `.model.rotary_emb`, `.lm_head`) as a ModelGraph, on fake tensors.

    `dtype` is the dtype of parameters (default: the model's). `autocast_dtype` traces under
    `torch.autocast` (mixed precision: fp32 parameters, bf16 matmuls), so the casts autocast
    inserts and the dtypes of saved activations are those that run. CPU autocast's op lists
    stand in for CUDA's (both run matmuls and attention in bf16, reductions in fp32).

    Raises:
        TrainplanError: the module is not a causal LM of that layout; the message says what
            was found.
    """
    core = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if core is None or not all(hasattr(core, a) for a in needed) or not hasattr(model, "lm_head"):
        raise TrainplanError(
            f"cannot capture {type(model).__name__}: trainplan plans causal LMs laid out like "
            "HF transformers (model.embed_tokens, model.layers, model.norm, model.rotary_emb, "
            "lm_head); use a preset or a transformers *ForCausalLM model")
    cfg = model.config
    dtype = dtype or next(model.parameters()).dtype
    b0, s0 = _pick_sentinels(model)
    n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    hidden, vocab = cfg.hidden_size, cfg.vocab_size
    mode = FakeTensorMode()
    regions: dict[str, Region] = {}

    with mode:
        ids = torch.zeros(b0, s0, dtype=torch.long)
        pos = torch.arange(s0)[None]
        x = torch.empty(b0, s0, hidden, dtype=dtype, requires_grad=True)
        g = torch.empty(b0, s0, hidden, dtype=dtype)
        labels = torch.zeros(b0, s0, dtype=torch.long)

    emb = core.embed_tokens
    rot = core.rotary_emb
    rot_buffers = {k: v for k, v in rot.named_buffers()}

    def head_fn(weight, ids, pos, g):
        h = torch.func.functional_call(emb, {"weight": weight}, (ids,))
        fake_rot = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in rot_buffers.items()}
        cos, sin = torch.func.functional_call(rot, fake_rot, (h, pos))
        (gw,) = torch.autograd.grad(h, [weight], g)
        return h, [gw], [cos, sin]

    ep = _fake_params(emb, mode, dtype)
    with mode:
        regions["head"] = trace_region(
            "head", head_fn, {"weight": ep["weight"], "ids": ids, "pos": pos, "g": g},
            kinds={"weight": "param", "ids": "const", "pos": "const", "g": "grad"},
            b0=b0, s0=s0, block=None, autocast_dtype=autocast_dtype)
        cos = torch.empty(1, s0, head_dim, dtype=dtype)
        sin = torch.empty(1, s0, head_dim, dtype=dtype)

    block_names: list[str] = []
    seen: dict[tuple, str] = {}
    for i, layer in enumerate(core.layers):
        sig = _block_signature(layer)
        if sig in seen:
            block_names.append(seen[sig])
            continue
        rname = f"block{len(seen)}"
        seen[sig] = rname
        block_names.append(rname)
        lp = _fake_params(layer, mode, dtype)
        pnames = list(lp)

        def block_fn(x, cos, sin, pos, g, _layer=layer, _pnames=pnames, **params):
            out = torch.func.functional_call(
                _layer, params, (x,),
                {"position_embeddings": (cos, sin), "position_ids": pos, "attention_mask": None})
            out = out[0] if isinstance(out, tuple) else out
            dx, *grads = torch.autograd.grad(out, [x] + [params[p] for p in _pnames], g)
            return out, grads, [dx]

        with mode:
            regions[rname] = trace_region(
                rname, block_fn, {"x": x, "cos": cos, "sin": sin, "pos": pos, "g": g, **lp},
                kinds={"x": "act", "cos": "shared", "sin": "shared", "pos": "const", "g": "grad",
                       **{p: "param" for p in pnames}},
                b0=b0, s0=s0, block=i, autocast_dtype=autocast_dtype)

    tail_mods = {"norm": core.norm, "lm_head": model.lm_head}
    tp = {f"{m}.{k}": v for m, mod in tail_mods.items()
          for k, v in _fake_params(mod, mode, dtype).items()}
    tnames = list(tp)

    def tail_fn(x, labels, **params):
        h = torch.func.functional_call(core.norm, {k[5:]: v for k, v in params.items()
                                                   if k.startswith("norm.")}, (x,))
        logits = torch.func.functional_call(model.lm_head, {k[8:]: v for k, v in params.items()
                                                            if k.startswith("lm_head.")}, (h,))
        loss = lm_loss(logits, labels)
        dx, *grads = torch.autograd.grad(loss, [x] + [params[p] for p in tnames])
        return loss, grads, [dx]

    with mode:
        regions["tail"] = trace_region(
            "tail", tail_fn, {"x": x, "labels": labels, **tp},
            kinds={"x": "act", "labels": "const", **{p: "param" for p in tnames}},
            b0=b0, s0=s0, block=None, autocast_dtype=autocast_dtype)

    if getattr(cfg, "tie_word_embeddings", False):
        warnings.warn("tied embeddings: the LM head's weight is counted once in model states",
                      stacklevel=2)
    n_params = sum(p.numel() for p in model.parameters())
    param_bytes = n_params * torch.empty((), dtype=dtype).element_size()
    return ModelGraph(name=name or getattr(model, "trainplan_preset", type(model).__name__),
                      n_params=n_params, param_bytes=param_bytes, regions=regions,
                      blocks=tuple(block_names), n_heads=n_heads, n_kv_heads=n_kv,
                      head_dim=head_dim, hidden_size=hidden, vocab_size=vocab)
