"""Graph capture: the op-level forward+backward graph of a model, on fake tensors.

What the planner reasons over must be what runs. Selective activation checkpointing's policy
sees ops *below* autograd (`aten.mm`, `aten._scaled_dot_product_flash_attention_for_cpu`, ...),
so each region is traced with `make_fx` over a function that runs forward and backward
(`torch.func.functional_call` + `torch.autograd.grad`) under `FakeTensorMode`: no memory is
allocated, so a 405B model captures on a laptop. Any causal LM qualifies: the regions come from
the model's own forward (`trainplan.planner.capture.layout`), not from attribute names:

- `head`: the forward up to the first block (embeddings, learned or rotary positions, an
  embedding scale, the masks the model builds);
- `block`: one layer, called with what the model called it with (identical layers, by
  parameters, call structure and settings, are traced once; Gemma-2's sliding and global
  layers are two regions);
- `tail`: the forward after the last block (final norm, LM head, logit softcapping) and the
  cross-entropy loss (`lm_loss`, which the executor uses too).

Shapes are made symbolic by tracing at sentinel sizes (micro-batch `B0`, sequence `S0`, primes
that divide no model dimension): every tensor dimension factors into powers of B0 and S0 and a
model constant, so `b*heads`, `b*s*top_k` and `s*s` all become polynomials in (b, s)
(`trainplan.planner.capture.trace._symbolize`), evaluated by the cost models for any micro-batch and
sequence length. FLOPs per node use torch's own formulas
(`torch.utils.flop_counter.flop_registry`), the same that `FlopCounterMode` applies at run time.

The trace runs with fake *CPU* tensors, so attention appears as
`_scaled_dot_product_flash_attention_for_cpu`; its saved tensors (q, k, v, out, logsumexp) are
those of the CUDA flash kernel, so the memory model carries over to GPUs.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from trainplan.costmodels.graph import Region, variant_key
from trainplan.errors import CaptureError, TrainplanError
from trainplan.modeling.activation_compression import check_activation_bits
from trainplan.modeling.loss import lm_loss
from trainplan.modeling.tiling import TiledHead, find_mlp, tile_mlp, untile_mlp
from trainplan.modeling.torch_private import FakeTensorMode, pytree
from trainplan.planner.capture.errors import capture_errors
from trainplan.planner.capture.layout import (
    BlockCall,
    Stop,
    as_run,
    attention_features,
    call_model,
    config_int,
    functional,
    handed,
    hidden_of,
    intercepted,
    logits_of,
    module_int,
    record_layout,
    with_hidden,
)
from trainplan.planner.capture.regions import RegionTable
from trainplan.planner.capture.sentinels import pick_sentinels
from trainplan.planner.capture.trace import trace_region

log = logging.getLogger(__name__)


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
    """Regions by key (`trainplan.costmodels.graph.variant_key`); tiled variants traced on first use."""
    blocks: tuple[str, ...]
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    intermediate_size: int = 0
    """The blocks' MLP width (the config's `intermediate_size`; 0 when it has none)."""
    features: tuple[str, ...] = ()
    n_active_params: int = 0
    """For a mixture of experts, the parameters one token runs through: all but the routed
    experts', plus `experts_per_token` / `experts` of theirs (`active_params`); 0 for a dense model."""
    """What the model's attention does beyond plain causal attention, as `name=value`
    (`trainplan.planner.capture.layout.attention_features`: a sliding window, softcapping, experts)."""
    n_layers: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "n_layers", len(self.blocks))

    @property
    def law_n_params(self) -> int:
        """The N the loss law is evaluated at: `n_active_params` for a mixture of experts, else
        `n_params` (`trainplan.planner.plan.Plan.law_n_params`)."""
        return self.n_active_params or self.n_params

    @property
    def distinct_blocks(self) -> dict[str, int]:
        """Region name -> how many layers run it."""
        out: dict[str, int] = {}
        for b in self.blocks:
            out[b] = out.get(b, 0) + 1
        return out


def _fake(tensors: dict[str, torch.Tensor], mode: FakeTensorMode, dtype: torch.dtype | None) -> dict:
    """Fake copies of parameters (requiring grad, at `dtype` if given) and buffers (own dtype)."""
    with mode:
        return {k: torch.empty(v.shape, dtype=(dtype if isinstance(v, nn.Parameter) and v.is_floating_point()
                                               else None) or v.dtype, device="cpu",
                               requires_grad=isinstance(v, nn.Parameter) and v.requires_grad)
                for k, v in tensors.items()}


def capture(model: nn.Module, *, dtype: torch.dtype | None = None, name: str | None = None,
            autocast_dtype: torch.dtype | None = None,
            activation_bits: tuple[int, ...] = (), device_type: str = "cpu",
            seq_len: int | None = None) -> ModelGraph:
    """Capture `model` as a ModelGraph, on fake tensors: any causal LM whose forward takes token
    ids and returns logits (a tensor, `.logits` or `(logits, ...)`) and runs its repeated
    blocks from an `nn.ModuleList` (`trainplan.planner.capture.layout`).

    `dtype` is the dtype of parameters (default: the model's). `autocast_dtype` traces under
    `torch.autocast` (mixed precision: fp32 parameters, bf16 matmuls), so the casts autocast
    inserts and the dtypes of saved activations are those that run. CPU autocast's op lists
    stand in for CUDA's (both run matmuls and attention in bf16, reductions in fp32).
    `activation_bits`: saved-activation widths below 32 to capture as well: each region is
    traced again under that compression and stored as `{region}@a{bits}` (e.g. `block0@a8`),
    which `trainplan.costmodels.step.model.StepModel.region_name` picks for blocks that are not checkpointed.
    `device_type`: the target device's attention and dropout kernels
    (`trainplan.planner.capture.device_kernels`; "cuda" for CUDA and ROCm profiles). `seq_len`: the
    sequence the plans will train at, when known: a model with a sliding window is traced with
    the window mask exactly when a run at that length builds one (`trainplan.planner.capture.sentinels.pick_sentinels`).

    Sequence-tiled variants (`trainplan.modeling.tiling`: a block's MLP or the tail's LM head and loss
    over `k` sequence chunks, keys `block0@m{k}`, `tail@l{k}`, `trainplan.planner.capture.regions`) are
    traced on first use, not here: `ModelGraph.regions` is a `RegionTable`.

    Raises:
        CaptureError: the module has no blocks, its forward does not return logits, or a
            region cannot be traced; the message names the op and the module where it failed.
    """
    tracer = RegionTracer(model, dtype=dtype, autocast_dtype=autocast_dtype, device_type=device_type,
                          seq_len=seq_len)
    variants = sorted({check_activation_bits(a) for a in activation_bits} - {32}, reverse=True)
    regions: dict[str, Region] = {}
    for bits in [32, *variants]:
        regions[variant_key("head", activation_bits=bits)] = tracer.trace("head", bits)
        for rname in tracer.layout.block_regions:
            regions[variant_key(rname, activation_bits=bits)] = tracer.trace(rname, bits)
        regions[variant_key("tail", activation_bits=bits)] = tracer.trace("tail", bits)
    if tracer.tied:  # a fact of the model, not a problem: the log's, at debug level (issue #40, item 12)
        log.debug("%s: tied embeddings, the LM head's weight is counted once in model states",
                  type(model).__name__)
    n_params = sum(p.numel() for p in model.parameters())
    n_active = active_params(model, tracer.features)
    param_bytes = n_params * torch.empty((), dtype=tracer.dtype).element_size()
    return ModelGraph(name=name or str(getattr(model, "trainplan_preset", type(model).__name__)),
                      n_params=n_params, param_bytes=param_bytes,
                      regions=RegionTable(regions, {"": tracer.trace}),
                      blocks=tuple(tracer.layout.layer_regions), n_heads=tracer.n_heads, n_kv_heads=tracer.n_kv,
                      head_dim=tracer.head_dim, hidden_size=tracer.hidden, vocab_size=tracer.vocab,
                      intermediate_size=tracer.intermediate, features=tracer.features, n_active_params=n_active)


def active_params(model: nn.Module, features: tuple[str, ...]) -> int:
    """Parameters one token runs through in a mixture of experts with `features` `experts=E` and
    `experts_per_token=k` (`trainplan.planner.capture.layout.attention_features`): every parameter
    not under a module path component named `experts` (attention, norms, embeddings, the router,
    shared experts such as Qwen-MoE's `shared_expert`), plus k / E of the routed experts' (Mixtral's
    `block_sparse_moe.experts.N.w1`, or a fused `experts.gate_up_proj` of shape (E, ...)). 0 for a
    model without experts."""
    feats = dict(f.split("=", 1) for f in features if "=" in f)
    if "experts" not in feats:
        return 0
    e, k = int(feats["experts"]), int(feats.get("experts_per_token", 1))
    routed = sum(p.numel() for name, p in model.named_parameters() if "experts" in name.split("."))
    total = sum(p.numel() for p in model.parameters())
    return int(round(total - routed + routed * min(k, e) / e)) if routed else 0


class RegionTracer:
    """Traces the regions of one causal LM (head, each distinct block, tail) on fake tensors, at
    any saved-activation width and sequence tiling (`trace`), through the model's own forward
    (`trainplan.planner.capture.layout`); `capture` keeps one for the variants traced on first use
    (`trainplan.planner.capture.regions.RegionTable`).

    - `head`: the model's forward up to its first block: what it hands the blocks (the hidden
      states, and rotary tables, masks, positions it builds once) and its backward;
    - a block region: one layer, called with what the model's forward called it with;
    - `tail`: the model's forward after its last block (final norm, LM head, logit softcapping,
      whatever the model does there) and the loss (`trainplan.modeling.loss.lm_loss`), forward and backward.

    Raises (constructor):
        CaptureError: no blocks, no logits, or the model's forward fails on fake tensors."""

    def __init__(self, model: nn.Module, *, dtype: torch.dtype | None, autocast_dtype: torch.dtype | None,
                 device_type: str, seq_len: int | None = None):
        self.model = model
        self.dtype = dtype or next(model.parameters()).dtype
        self.autocast_dtype, self.device_type = autocast_dtype, device_type
        self.b0, self.s0 = pick_sentinels(model, seq_len)
        self.mode = FakeTensorMode()
        params = dict(model.named_parameters())
        self.param_names = frozenset(params)
        self.tensors = _fake({**params, **dict(model.named_buffers())}, self.mode, dtype)
        self.tied = len(params) < len(dict(model.named_parameters(remove_duplicate=False)))
        with self.mode:
            ids = torch.zeros(self.b0, self.s0, dtype=torch.long)
        with capture_errors(model, "its forward", before_blocks=True):
            self.layout = record_layout(model, self.tensors, ids, self.mode)
        self._layouts = {1: self.layout}
        prefix = self.layout.blocks_name + "."
        self.outer = [k for k in self.tensors if not k.startswith(prefix)]
        self.hidden, self.vocab = self.layout.hidden_size, self.layout.vocab_size
        self.n_heads = config_int(model, "num_attention_heads", "n_head") \
            or module_int(model, "num_attention_heads", "num_heads", "n_head", "n_heads") or 1
        self.n_kv = config_int(model, "num_key_value_heads") \
            or module_int(model, "num_key_value_heads", "num_kv_heads", "n_kv_heads") or self.n_heads
        self.head_dim = config_int(model, "head_dim") or module_int(model, "head_dim") or self.hidden // self.n_heads
        self.intermediate = config_int(model, "intermediate_size", "n_inner") or 0
        self.features = attention_features(model, self.layout)

    def _layout(self, chunks: int):
        """The layout recorded at the sequence a `chunks`-tiled trace runs at (the blocks' call
        arguments, rotary tables and masks, have that length)."""
        if chunks not in self._layouts:
            with self.mode:
                ids = torch.zeros(self.b0, self.s0 * chunks, dtype=torch.long)
            with capture_errors(self.model, "its forward"):
                self._layouts[chunks] = record_layout(self.model, self.tensors, ids, self.mode)
        return self._layouts[chunks]

    def _kinds(self, names) -> dict[str, str]:
        return {k: "param" if k in self.param_names else "const" for k in names}

    def trace(self, region: str, activation_bits: int = 32, chunks: int = 1) -> Region:
        """The region `region` (`head`, `tail` or a block region name) traced with saved
        activations at `activation_bits`; `chunks` > 1 tiles the sequence (`trainplan.modeling.tiling`):
        a block's MLP or the tail's LM head and loss over that many chunks.

        Raises:
            TrainplanError: an unknown region, tiling of the head, or a tiling the model does
                not allow (no MLP child; logits post-processed after the LM head).
            CaptureError: the region cannot be traced; the message names the op and module."""
        b0, s0 = self.b0, self.s0 * chunks
        if chunks > 1 and region == "head":
            raise TrainplanError(f"cannot tile {region!r} into {chunks} chunks: the head is not tiled")
        name = variant_key(region, activation_bits=activation_bits, chunks=chunks)
        common: dict[str, Any] = dict(b0=b0, s0=s0, autocast_dtype=self.autocast_dtype,
                                      activation_bits=activation_bits,
                                      device_type=self.device_type, chunks=chunks)
        mode, dtype = self.mode, self.dtype
        with mode:
            ids = torch.zeros(b0, s0, dtype=torch.long)
            g = torch.empty(b0, s0, self.hidden, dtype=dtype)
            labels = torch.zeros(b0, s0, dtype=torch.long)
            x = torch.empty(b0, s0, self.hidden, dtype=dtype, requires_grad=True)
        outer = {k: self.tensors[k] for k in self.outer}
        if region == "head":
            with capture_errors(self.model, "its head (the forward up to the first block)"), mode, as_run():
                return trace_region(name, self._head_fn, {"ids": ids, "g": g, **outer},
                                    kinds={"ids": "const", "g": "grad", **self._kinds(outer)},
                                    block=None, **common)
        if region == "tail":
            if chunks > 1 and not self.layout.head_logits:
                raise TrainplanError(f"cannot tile the loss of {type(self.model).__name__}: its logits are not its "
                                     "output embedding's output (it has none, or changes the logits after it, "
                                     "e.g. softcapping)")
            held: list = []
            fn = partial(self._tail_fn, held=held, chunks=chunks)
            what = "its tail (the forward after the last block, and the loss)"
            with capture_errors(self.model, what), mode, as_run():
                # untiled, lm_loss holds the logits until it returns (`trace_region`)
                return trace_region(name, fn, {"x": x, "labels": labels, "ids": ids, **outer},
                                    kinds={"x": "act", "labels": "const", "ids": "const", **self._kinds(outer)},
                                    block=None, held_to_output=("aten._log_softmax.default",) if chunks == 1 else (),
                                    held=held, keep_from=("x", "labels"), **common)
        if region not in self.layout.block_regions:
            raise TrainplanError(f"no region {region!r}: regions are head, tail and "
                                 f"{', '.join(self.layout.block_regions)}")
        i = self.layout.block_regions[region]
        layer = self.layout.blocks[i]
        prefix = f"{self.layout.blocks_name}.{i}."
        lp = {k[len(prefix):]: v for k, v in self.tensors.items() if k.startswith(prefix)}
        call = self._layout(chunks).calls[i]
        leaves, spec = pytree.tree_flatten((call.args, call.kwargs))
        hidden, _ = hidden_of(call.args, call.kwargs)
        slots = {f"in{j}": (leaf.detach() if leaf.requires_grad else leaf) for j, leaf in enumerate(leaves)
                 if isinstance(leaf, torch.Tensor) and leaf is not hidden}
        where = ["x" if leaf is hidden else f"in{j}" if f"in{j}" in slots else None for j, leaf in enumerate(leaves)]
        mlp = find_mlp(layer) if chunks > 1 else None
        if mlp is not None:
            tile_mlp(mlp, chunks)
        try:
            with capture_errors(self.model, f"block {i} ({self.layout.blocks_name}.{i})"), mode, as_run():
                return dataclasses.replace(trace_region(
                    name, partial(self._block_fn, layer=layer, leaves=leaves, where=where, spec=spec,
                                  pnames=[p for p in lp if prefix + p in self.param_names]),
                    {"x": x, "g": g, **slots, **{f"p.{k}": v for k, v in lp.items()}},
                    kinds={"x": "act", "g": "grad", **dict.fromkeys(slots, "shared"),
                           **{f"p.{k}": "param" if prefix + k in self.param_names else "const" for k in lp}},
                    block=i, **common), recompute_to_end=chunks > 1)
        finally:
            if mlp is not None:
                untile_mlp(mlp)

    def _head_fn(self, ids, g, **tensors):
        calls: list[BlockCall] = []
        last = len(self.layout.blocks) - 1

        def record(i, block, orig, *args, **kwargs):  # every block's call, up to the last one's
            calls.append(BlockCall(args, kwargs))
            if i == last:
                raise Stop(args, kwargs)
            sample = self.layout.outputs[self.layout.block_regions[self.layout.layer_regions[i]]]
            return with_hidden(sample, hidden_of(args, kwargs)[0])

        try:
            with intercepted(self.layout.blocks, record):
                functional(self.model, tensors, lambda m: call_model(m, ids))
        except Stop:
            pass
        else:
            raise CaptureError(f"the forward of {type(self.model).__name__} returned without calling its last block")
        hidden, _ = hidden_of(calls[0].args, calls[0].kwargs)
        shared = handed(calls)
        params = [v for k, v in tensors.items() if k in self.param_names and v.requires_grad]
        grads = torch.autograd.grad(hidden, params, g, allow_unused=True)
        return hidden, [gr for gr in grads if gr is not None], shared

    @staticmethod
    def _block_fn(x, g, *, layer, leaves, where, spec, pnames, **inputs):
        vals = [x if w == "x" else inputs[w] if w is not None else leaf for leaf, w in zip(leaves, where, strict=True)]
        args, kwargs = pytree.tree_unflatten(vals, spec)
        params = {k[2:]: v for k, v in inputs.items() if k.startswith("p.")}

        def run(scoped):
            out = scoped(*args, **kwargs)
            out = out[0] if isinstance(out, tuple) else out
            dx, *grads = torch.autograd.grad(out, [x] + [params[p] for p in pnames], g)
            return out, grads, [dx]

        # forward and backward inside one functional call: a tiled MLP's checkpoint recomputes
        # its chunks in the backward, with the fake parameters still in place
        return functional(layer, params, run)

    def _tail_fn(self, x, labels, ids, *, held, chunks, **tensors):
        blocks, last = self.layout.blocks, len(self.layout.blocks) - 1
        first = self.layout.block_regions

        def passthrough(i, block, orig, *args, **kwargs):
            sample = self.layout.outputs[first[self.layout.layer_regions[i]]]
            return with_hidden(sample, x if i == last else hidden_of(args, kwargs)[0])

        params = [v for k, v in tensors.items() if k in self.param_names and v.requires_grad]

        def run(model):  # forward and backward inside one functional call: the tiled loss's
            if chunks == 1:  # checkpoints recompute in the backward, with the fake parameters in place
                logits = logits_of(call_model(model, ids))
                held.append(logits)  # the executor's lm_loss(logits, ...) holds them until it returns
                loss = lm_loss(logits, labels)
            else:
                assert head is not None
                with head.labels(labels):
                    loss = logits_of(call_model(model, ids))
            dx, *grads = torch.autograd.grad(loss, [x] + params, allow_unused=True)
            return loss, [gr for gr in grads if gr is not None], [dx]

        head = TiledHead(self.model, chunks) if chunks > 1 else None
        try:
            with intercepted(blocks, passthrough):
                return functional(self.model, tensors, run)
        finally:
            if head is not None:
                untile_mlp(self.model.get_output_embeddings())  # type: ignore[operator]
