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
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from costmodels.graph import Region
from modeling.activation_compression import check_activation_bits
from modeling.loss import lm_loss
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


def _variant(name: str, activation_bits: int) -> str:
    """Region key of `name` captured with saved activations at `activation_bits`."""
    return name if activation_bits == 32 else f"{name}@a{activation_bits}"


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
    cfg: Any = model.config  # a transformers config: its fields differ by model family
    lm_head = model.get_submodule("lm_head")
    dtype = dtype or next(model.parameters()).dtype
    b0, s0 = _pick_sentinels(model)
    n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    hidden, vocab = cfg.hidden_size, cfg.vocab_size
    variants = sorted({check_activation_bits(a) for a in activation_bits} - {32}, reverse=True)
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
    for bits in [32, *variants]:
        with mode:
            regions[_variant("head", bits)] = trace_region(
                _variant("head", bits), head_fn, {"weight": ep["weight"], "ids": ids, "pos": pos, "g": g},
                kinds={"weight": "param", "ids": "const", "pos": "const", "g": "grad"},
                b0=b0, s0=s0, block=None, autocast_dtype=autocast_dtype, activation_bits=bits,
                    device_type=device_type)
    with mode:
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

        for bits in [32, *variants]:
            with mode:
                regions[_variant(rname, bits)] = trace_region(
                    _variant(rname, bits), block_fn, {"x": x, "cos": cos, "sin": sin, "pos": pos, "g": g, **lp},
                    kinds={"x": "act", "cos": "shared", "sin": "shared", "pos": "const", "g": "grad",
                           **{p: "param" for p in pnames}},
                    b0=b0, s0=s0, block=i, autocast_dtype=autocast_dtype, activation_bits=bits,
                    device_type=device_type)

    tail_mods = {"norm": core.norm, "lm_head": lm_head}
    held: list = []
    tp = {f"{m}.{k}": v for m, mod in tail_mods.items()
          for k, v in _fake_params(mod, mode, dtype).items()}
    tnames = list(tp)

    def tail_fn(x, labels, **params):
        h = torch.func.functional_call(core.norm, {k[5:]: v for k, v in params.items()
                                                   if k.startswith("norm.")}, (x,))
        logits = torch.func.functional_call(lm_head, {k[8:]: v for k, v in params.items()
                                                            if k.startswith("lm_head.")}, (h,))
        held.append(logits)  # the executor's lm_loss(logits, ...) holds them until it returns
        loss = lm_loss(logits, labels)
        dx, *grads = torch.autograd.grad(loss, [x] + [params[p] for p in tnames])
        return loss, grads, [dx]

    for bits in [32, *variants]:
        held.clear()
        with mode:
            regions[_variant("tail", bits)] = trace_region(
                _variant("tail", bits), tail_fn, {"x": x, "labels": labels, **tp},
                kinds={"x": "act", "labels": "const", **{p: "param" for p in tnames}},
                b0=b0, s0=s0, block=None, autocast_dtype=autocast_dtype, activation_bits=bits,
                held_to_output=("aten._log_softmax.default",), held=held, device_type=device_type)

    if getattr(cfg, "tie_word_embeddings", False):
        warnings.warn("tied embeddings: the LM head's weight is counted once in model states",
                      stacklevel=2)
    n_params = sum(p.numel() for p in model.parameters())
    param_bytes = n_params * torch.empty((), dtype=dtype).element_size()
    return ModelGraph(name=name or str(getattr(model, "trainplan_preset", type(model).__name__)),
                      n_params=n_params, param_bytes=param_bytes, regions=regions,
                      blocks=tuple(block_names), n_heads=n_heads, n_kv_heads=n_kv,
                      head_dim=head_dim, hidden_size=hidden, vocab_size=vocab)
