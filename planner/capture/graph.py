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

import dataclasses
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from costmodels.graph import Region, variant_key
from modeling.activation_compression import check_activation_bits
from modeling.loss import lm_loss
from modeling.tiling import find_mlp, tile_mlp, tiled_lm_loss, untile_mlp
from planner.capture.regions import RegionTable
from planner.capture.trace import trace_region
from trainplan_errors import TrainplanError

_SENTINELS = [(7, 113), (11, 127), (13, 131), (5, 139)]

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
    regions: RegionTable
    """Regions by key (`costmodels.graph.variant_key`); tiled variants traced on first use."""
    blocks: tuple[str, ...]
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    intermediate_size: int = 0
    """The blocks' MLP width (the config's `intermediate_size`; 0 when it has none)."""
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


def _model_dims(model: nn.Module) -> set[int]:
    """Every parameter dimension and integer config field of `model`: sizes a sentinel must avoid."""
    dims = {int(d) for p in model.parameters() for d in p.shape}
    cfg = getattr(model, "config", None)
    if cfg is not None:
        dims |= {int(v) for v in vars(cfg).values() if isinstance(v, int) and not isinstance(v, bool)}
    return dims


def _pick_sentinels(model: nn.Module) -> tuple[int, int]:
    dims = _model_dims(model)
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
            autocast_dtype: torch.dtype | None = None,
            activation_bits: tuple[int, ...] = (), device_type: str = "cpu") -> ModelGraph:
    """Capture `model` (a HF-style causal LM: `.model.embed_tokens`, `.model.layers`,
    `.model.norm`, `.model.rotary_emb`, `.lm_head`) as a ModelGraph, on fake tensors.

    `dtype` is the dtype of parameters (default: the model's). `autocast_dtype` traces under
    `torch.autocast` (mixed precision: fp32 parameters, bf16 matmuls), so the casts autocast
    inserts and the dtypes of saved activations are those that run. CPU autocast's op lists
    stand in for CUDA's (both run matmuls and attention in bf16, reductions in fp32).
    `activation_bits`: saved-activation widths below 32 to capture as well: each region is
    traced again under that compression and stored as `{region}@a{bits}` (e.g. `block0@a8`),
    which `costmodels.step.model.StepModel.region_name` picks for blocks that are not checkpointed.
    `device_type`: the target device's attention and dropout kernels
    (`planner.capture.device_kernels`; "cuda" for CUDA and ROCm profiles).

    Sequence-tiled variants (`modeling.tiling`: a block's MLP or the tail's LM head and loss
    over `k` sequence chunks, keys `block0@m{k}`, `tail@l{k}`, `planner.capture.regions`) are
    traced on first use, not here: `ModelGraph.regions` is a `RegionTable`.

    Raises:
        TrainplanError: the module is not a causal LM of that layout; the message says what
            was found.
    """
    tracer = RegionTracer(model, dtype=dtype, autocast_dtype=autocast_dtype, device_type=device_type)
    cfg: Any = model.config  # a transformers config: its fields differ by model family
    variants = sorted({check_activation_bits(a) for a in activation_bits} - {32}, reverse=True)
    regions: dict[str, Region] = {}
    block_names: list[str] = []
    for bits in [32, *variants]:
        regions[variant_key("head", activation_bits=bits)] = tracer.trace("head", bits)
        for rname in tracer.block_regions:
            regions[variant_key(rname, activation_bits=bits)] = tracer.trace(rname, bits)
        regions[variant_key("tail", activation_bits=bits)] = tracer.trace("tail", bits)
    block_names = list(tracer.layer_regions)
    if getattr(cfg, "tie_word_embeddings", False):
        warnings.warn("tied embeddings: the LM head's weight is counted once in model states",
                      stacklevel=2)
    n_params = sum(p.numel() for p in model.parameters())
    param_bytes = n_params * torch.empty((), dtype=tracer.dtype).element_size()
    return ModelGraph(name=name or str(getattr(model, "trainplan_preset", type(model).__name__)),
                      n_params=n_params, param_bytes=param_bytes,
                      regions=RegionTable(regions, {"": tracer.trace}),
                      blocks=tuple(block_names), n_heads=tracer.n_heads, n_kv_heads=tracer.n_kv,
                      head_dim=tracer.head_dim, hidden_size=tracer.hidden, vocab_size=tracer.vocab,
                      intermediate_size=int(getattr(cfg, "intermediate_size", 0) or 0))


class RegionTracer:
    """Traces the regions of one causal LM (head, each distinct block, tail) on fake tensors, at
    any saved-activation width and sequence tiling (`trace`); `capture` keeps one for the
    variants traced on first use (`planner.capture.regions.RegionTable`).

    Raises (constructor):
        TrainplanError: the module is not a causal LM laid out like HF transformers."""

    def __init__(self, model: nn.Module, *, dtype: torch.dtype | None, autocast_dtype: torch.dtype | None,
                 device_type: str):
        core = getattr(model, "model", None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if core is None or not all(hasattr(core, a) for a in needed) or not hasattr(model, "lm_head"):
            raise TrainplanError(
                f"cannot capture {type(model).__name__}: trainplan plans causal LMs laid out like "
                "HF transformers (model.embed_tokens, model.layers, model.norm, model.rotary_emb, "
                "lm_head); use a preset or a transformers *ForCausalLM model")
        cfg: Any = model.config
        self.model, self.core, self.lm_head = model, core, model.get_submodule("lm_head")
        self.dtype = dtype or next(model.parameters()).dtype
        self.autocast_dtype, self.device_type = autocast_dtype, device_type
        self.dims = _model_dims(model)
        self.b0, self.s0 = _pick_sentinels(model)
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.hidden, self.vocab = cfg.hidden_size, cfg.vocab_size
        self.mode = FakeTensorMode()
        self.layer_regions: list[str] = []
        """Region name of each layer, in order (identical layers share one)."""
        self.block_regions: dict[str, int] = {}
        """Region name -> index of the first layer that runs it."""
        seen: dict[tuple, str] = {}
        for i, layer in enumerate(core.layers):
            sig = _block_signature(layer)
            if sig not in seen:
                seen[sig] = f"block{len(seen)}"
                self.block_regions[seen[sig]] = i
            self.layer_regions.append(seen[sig])
        self._params: dict[str, dict] = {}

    def _fake(self, key: str, module: nn.Module) -> dict:
        if key not in self._params:
            self._params[key] = _fake_params(module, self.mode, self.dtype)
        return self._params[key]

    def trace(self, region: str, activation_bits: int = 32, chunks: int = 1) -> Region:
        """The region `region` (`head`, `tail` or a block region name) traced with saved
        activations at `activation_bits`; `chunks` > 1 tiles the sequence (`modeling.tiling`):
        a block's MLP or the tail's LM head and loss over that many chunks.

        Raises:
            TrainplanError: an unknown region, tiling of the head, or a chunk count whose
                sentinel sequence collides with a model dimension."""
        b0, s0 = self.b0, self.s0 * chunks
        if chunks > 1 and (region == "head" or self.dims & {s0, b0 * s0}):
            raise TrainplanError(f"cannot tile {region!r} into {chunks} chunks: "
                                 + ("the head is not tiled" if region == "head" else
                                    f"the trace's sequence {s0} equals a model dimension"))
        name = variant_key(region, activation_bits=activation_bits, chunks=chunks)
        common: dict[str, Any] = dict(b0=b0, s0=s0, autocast_dtype=self.autocast_dtype,
                                      activation_bits=activation_bits,
                      device_type=self.device_type, chunks=chunks)
        mode, dtype = self.mode, self.dtype
        with mode:
            ids = torch.zeros(b0, s0, dtype=torch.long)
            pos = torch.arange(s0)[None]
            x = torch.empty(b0, s0, self.hidden, dtype=dtype, requires_grad=True)
            g = torch.empty(b0, s0, self.hidden, dtype=dtype)
            labels = torch.zeros(b0, s0, dtype=torch.long)
        if region == "head":
            ep = self._fake("head", self.core.embed_tokens)
            with mode:
                return trace_region(name, self._head_fn, {"weight": ep["weight"], "ids": ids, "pos": pos, "g": g},
                                    kinds={"weight": "param", "ids": "const", "pos": "const", "g": "grad"},
                                    block=None, **common)
        if region == "tail":
            held: list = []
            tp = {f"norm.{k}": v for k, v in self._fake("norm", self.core.norm).items()}
            tp |= {f"lm_head.{k}": v for k, v in self._fake("lm_head", self.lm_head).items()}
            fn = partial(self._tail_fn, held=held, chunks=chunks, pnames=list(tp))
            with mode:  # untiled, lm_loss holds the logits until it returns (`trace_region`)
                return trace_region(name, fn, {"x": x, "labels": labels, **tp},
                                    kinds={"x": "act", "labels": "const", **{p: "param" for p in tp}},
                                    block=None, held_to_output=("aten._log_softmax.default",) if chunks == 1 else (),
                                    held=held, **common)
        if region not in self.block_regions:
            raise TrainplanError(f"no region {region!r}: regions are head, tail and "
                                 f"{', '.join(self.block_regions)}")
        i = self.block_regions[region]
        layer = self.core.layers[i]
        lp = self._fake(region, layer)
        with mode:
            cos = torch.empty(1, s0, self.head_dim, dtype=dtype)
            sin = torch.empty(1, s0, self.head_dim, dtype=dtype)
        mlp = find_mlp(layer) if chunks > 1 else None
        if mlp is not None:
            tile_mlp(mlp, chunks)
        try:
            with mode:
                return dataclasses.replace(trace_region(
                    name, partial(self._block_fn, layer=layer, pnames=list(lp)),
                    {"x": x, "cos": cos, "sin": sin, "pos": pos, "g": g, **lp},
                    kinds={"x": "act", "cos": "shared", "sin": "shared", "pos": "const", "g": "grad",
                           **{p: "param" for p in lp}}, block=i, **common), recompute_to_end=chunks > 1)
        finally:
            if mlp is not None:
                untile_mlp(mlp)

    def _head_fn(self, weight, ids, pos, g):
        h = torch.func.functional_call(self.core.embed_tokens, {"weight": weight}, (ids,))
        rot = self.core.rotary_emb
        fake_rot = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in rot.named_buffers()}
        cos, sin = torch.func.functional_call(rot, fake_rot, (h, pos))
        (gw,) = torch.autograd.grad(h, [weight], g)
        return h, [gw], [cos, sin]

    @staticmethod
    def _block_fn(x, cos, sin, pos, g, *, layer, pnames, **params):
        def run(scoped):
            out = scoped(x, position_embeddings=(cos, sin), position_ids=pos, attention_mask=None)
            out = out[0] if isinstance(out, tuple) else out
            dx, *grads = torch.autograd.grad(out, [x] + [params[p] for p in pnames], g)
            return out, grads, [dx]

        # forward and backward inside one functional_call: a tiled MLP's checkpoint recomputes
        # its chunks in the backward, with the fake parameters still in place
        return torch.func.functional_call(_Scope(layer), {f"inner.{k}": v for k, v in params.items()},
                                          (run,))

    def _tail_fn(self, x, labels, *, held, chunks, pnames, **params):
        norm = {k[5:]: v for k, v in params.items() if k.startswith("norm.")}
        head = {k[8:]: v for k, v in params.items() if k.startswith("lm_head.")}
        h = torch.func.functional_call(self.core.norm, norm, (x,))
        if chunks == 1:
            logits = torch.func.functional_call(self.lm_head, head, (h,))
            held.append(logits)  # the executor's lm_loss(logits, ...) holds them until it returns
            loss = lm_loss(logits, labels)
        else:
            loss = tiled_lm_loss(h, partial(torch.func.functional_call, self.lm_head, head), labels, chunks)
        dx, *grads = torch.autograd.grad(loss, [x] + [params[p] for p in pnames])
        return loss, grads, [dx]


class _Scope(nn.Module):
    """`inner` as a child, so `torch.func.functional_call(_Scope(inner), {"inner.<name>": ...},
    (fn,))` runs `fn(inner)` with the given parameters in place for all of `fn`: a forward and
    its backward, whose checkpoint recomputes (`modeling.tiling`) read the module's parameters."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, fn):
        return fn(self.inner)
