"""A model's layout as its own forward shows it: the repeated blocks, what each block is called
with, and the dimensions the cost models need, for any causal LM `nn.Module`.

Nothing here goes by attribute names. The blocks are the model's `nn.ModuleList` holding the
most parameters (`find_blocks`). One forward of the whole model on fake tensors, with each
block's forward intercepted, records the arguments every block receives (`record_layout`):
the hidden states, and whatever the model builds for it (rotary cos/sin, an attention mask, a
sliding-window mask, position ids). Layers that differ in parameters, in the structure of what
they are called with (Gemma-2's sliding and global layers receive different masks) or in a
scalar setting of a submodule (a layer's window) are different regions; identical layers are
traced once. `trainplan.planner.capture.graph` traces the regions from this record.

The record's forward runs the model as a training step runs it (`trainplan.modeling.fake_run.as_run`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainplan.errors import CaptureError, TrainplanError
from trainplan.modeling.fake_run import as_run
from trainplan.modeling.model_call import accepts_position_ids, forward_call
from trainplan.modeling.torch_private import pytree

_SCALARS = (bool, int, float, str, type(None))


class Stop(Exception):  # noqa: N818  (control flow, not an error)
    """Raised by an intercepted block to end the model's forward there (the head's trace)."""

    def __init__(self, args: tuple, kwargs: dict):
        super().__init__("stopped at the first block")
        self.args, self.kwargs = args, kwargs


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's transformer blocks: (qualified name, list) of the `nn.ModuleList` whose
    modules hold the most parameters (HF's `model.layers`, GPT-2's `transformer.h`, a
    nanoGPT's `transformer.h`; a MoE's expert lists sit inside the blocks and hold less).

    Raises:
        CaptureError: the model has no `nn.ModuleList` with parameters; the message lists its
            children."""
    lists = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) and any(True for _ in m.parameters())]
    if not lists:
        children = ", ".join(f"{n} ({type(c).__name__})" for n, c in model.named_children()) or "none"
        raise CaptureError(f"cannot capture {type(model).__name__}: it has no nn.ModuleList of blocks "
                           f"(its children: {children}); trainplan plans models whose repeated "
                           "layers are an nn.ModuleList called in order by the model's forward")
    return max(lists, key=lambda t: (sum(p.numel() for p in t[1].parameters()), -t[0].count(".")))


def call_model(model: nn.Module, ids: torch.Tensor) -> Any:
    """`model`'s forward on token ids (b, s), called as the executor calls it
    (`trainplan.modeling.model_call.forward_call`: `input_ids=` or positionally, `use_cache=False` where
    the forward names it)."""
    args, kwargs = forward_call(model, ids)
    return model(*args, **kwargs)


def logits_of(out: Any, who: str = "the model") -> torch.Tensor:
    """The logits in a forward's output: the tensor itself, `.logits`, `["logits"]` or the first
    element of a tuple.

    Raises:
        CaptureError: none of these is a tensor."""
    if isinstance(out, torch.Tensor):
        return out
    if getattr(out, "last_hidden_state", None) is not None and getattr(out, "logits", None) is None:
        raise CaptureError(f"cannot capture {who}: its forward returned {type(out).__name__} (hidden states, "
                           "no logits): it is a decoder without its LM head; plan its *ForCausalLM model")
    for get in (lambda o: o.logits, lambda o: o["logits"], lambda o: o[0]):
        try:
            val = get(out)
        except (AttributeError, KeyError, IndexError, TypeError):
            continue
        if isinstance(val, torch.Tensor):
            return val
    raise CaptureError(f"cannot capture {who}: its forward returned {type(out).__name__}, not logits: trainplan "
                       "needs a forward that returns logits (b, s, V), an object with .logits, or (logits, ...)")


def hidden_of(args: tuple, kwargs: dict) -> tuple[torch.Tensor, str | int]:
    """The hidden states a block is called with and where they are: (tensor, position or name).

    Raises:
        CaptureError: the block's first argument (or `hidden_states=`) is not a tensor."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0], 0
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"], "hidden_states"
    raise CaptureError("a block was called without hidden states as its first argument or hidden_states=; "
                       "trainplan needs blocks called as block(hidden_states, ...)")


def with_hidden(out: Any, hidden: torch.Tensor) -> Any:
    """A block's output with its hidden states replaced by `hidden` (a tensor, or the first
    element of a tuple)."""
    if isinstance(out, torch.Tensor):
        return hidden
    if isinstance(out, tuple):
        return (hidden, *out[1:])
    raise CaptureError(f"a block returned {type(out).__name__}: trainplan needs blocks that return the hidden "
                       "states or a tuple starting with them")


@dataclass
class BlockCall:
    """What one block was called with in the recorded forward (fake tensors)."""

    args: tuple
    kwargs: dict


@dataclass
class Layout:
    """The recorded layout of a model (`record_layout`)."""

    blocks_name: str
    blocks: nn.ModuleList
    calls: list[BlockCall]
    """What each layer was called with, in order."""
    layer_regions: list[str]
    """Region name of each layer (identical layers share one)."""
    block_regions: dict[str, int]
    """Region name -> index of its first layer."""
    hidden_size: int
    vocab_size: int
    head_logits: bool
    """The model's logits are its output embedding's output, untouched (a tiled loss can
    replace them); False when the model post-processes them (Gemma-2's softcapping) or has no
    output embedding."""
    outputs: dict[int, Any] = field(default_factory=dict)
    """A sample output of the first layer of each region, by layer index."""


def handed(calls: list[BlockCall]) -> list[torch.Tensor]:
    """The distinct tensors the blocks are called with besides their hidden states (rotary
    tables, masks, position ids), in order of first appearance over the layers' calls."""
    seen: set[int] = set()
    tensors: list[torch.Tensor] = []
    for c in calls:
        hidden, _ = hidden_of(c.args, c.kwargs)
        for leaf in pytree.tree_leaves((c.args, c.kwargs)):
            if isinstance(leaf, torch.Tensor) and leaf is not hidden and id(leaf) not in seen:
                seen.add(id(leaf))
                tensors.append(leaf)
    return tensors


@contextlib.contextmanager
def intercepted(blocks: nn.ModuleList, forward) -> Iterator[None]:
    """Each block's forward replaced by `forward(i, block, orig, *args, **kwargs)` (`orig`: the
    forward it had, an instance attribute included, given back on exit)."""
    had = [block.__dict__.get("forward") for block in blocks]
    try:
        for i, block in enumerate(blocks):
            orig = block.forward

            def fwd(*args, _i=i, _b=block, _orig=orig, **kwargs):
                return forward(_i, _b, _orig, *args, **kwargs)

            block.__dict__["forward"] = fwd
        yield
    finally:
        for block, before in zip(blocks, had, strict=True):
            if before is None:
                block.__dict__.pop("forward", None)
            else:
                block.__dict__["forward"] = before


def _tensor_structure(calls: list[BlockCall]) -> list[tuple]:
    """Per layer, the structure of its call: non-hidden tensors as (shape, dtype, which object
    among all calls' tensors), scalars as themselves."""
    ids: dict[int, int] = {}
    out = []
    for c in calls:
        leaves, spec = pytree.tree_flatten((c.args, c.kwargs))
        hidden, _ = hidden_of(c.args, c.kwargs)
        sig: list[object] = []
        for leaf in leaves:
            if leaf is hidden:
                sig.append("hidden")
            elif isinstance(leaf, torch.Tensor):
                sig.append((tuple(leaf.shape), str(leaf.dtype), ids.setdefault(id(leaf), len(ids))))
            elif isinstance(leaf, _SCALARS):
                sig.append(leaf)
            else:
                sig.append(type(leaf).__name__)
        out.append((str(spec), tuple(sig)))
    return out


def _attribute_structure(blocks: nn.ModuleList) -> list[tuple]:
    """Per layer, the scalar attributes of its submodules (a window, a layer type), leaving out
    those that only number the layers (`layer_idx`: a distinct int per layer)."""
    per_layer = [{(path, k): v for path, m in b.named_modules() for k, v in vars(m).items()
                  if not k.startswith("_") and k != "training" and isinstance(v, _SCALARS)}
                 for b in blocks]
    keys = set().union(*per_layer) if per_layer else set()
    numbering = {k for k in keys if len(blocks) > 1
                 and all(isinstance(d.get(k), int) and not isinstance(d.get(k), bool) for d in per_layer)
                 and len({d[k] for d in per_layer}) == len(blocks)}
    return [tuple(sorted((k, repr(v)) for k, v in d.items() if k not in numbering)) for d in per_layer]


def _param_structure(block: nn.Module) -> tuple:
    return (type(block).__name__,) + tuple((k, tuple(v.shape), str(v.dtype))
                                           for k, v in [*block.named_parameters(), *block.named_buffers()])


def record_layout(model: nn.Module, tensors: dict[str, torch.Tensor], ids: torch.Tensor,
                  mode: Any) -> Layout:
    """Run `model`'s forward once on fake `tensors` (every parameter and buffer by qualified
    name) and token ids `ids`, under fake-tensor `mode`, recording what each block is called
    with; the first layer of each distinct signature runs for real (on fake tensors), the
    others pass their input through (`with_hidden`), so a 126-layer model costs one layer.

    Raises:
        CaptureError: no blocks, or a block not called as `block(hidden_states, ...)`."""
    name, blocks = find_blocks(model)
    params = [_param_structure(b) for b in blocks]
    calls: list[BlockCall] = []
    outputs: dict[int, Any] = {}
    seen_out: dict[tuple, Any] = {}

    def forward(i, block, orig, *args, **kwargs):
        hidden, _ = hidden_of(args, kwargs)
        if not hidden.is_floating_point():
            raise CaptureError(
                f"cannot capture {type(model).__name__}: its forward handed its first block {name}.{i} "
                f"{hidden.dtype} values, not hidden states: its forward takes no token ids (it expects "
                "embeddings?); trainplan calls the forward with token ids (b, s) int64, "
                "as input_ids= or its first argument: give a model whose forward takes token ids and returns logits")
        calls.append(BlockCall(args, kwargs))
        key = (params[i], _tensor_structure([calls[-1]])[0])
        if key not in seen_out:
            seen_out[key] = orig(*args, **kwargs)
            outputs[i] = seen_out[key]
            return seen_out[key]
        return with_hidden(seen_out[key], hidden)

    head = getattr(model, "get_output_embeddings", lambda: None)()
    head_out: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda m, a, o: head_out.append(o)) if isinstance(head, nn.Module) else None
    try:
        with mode, as_run(), intercepted(blocks, forward):
            logits = logits_of(functional(model, tensors, lambda m: call_model(m, ids)), type(model).__name__)
    finally:
        if hook is not None:
            hook.remove()
    if len(calls) != len(blocks):
        what = (f"made {len(calls)} block calls for the {len(blocks)} blocks in {name} (a block run more than "
                "once per forward, shared weights)" if len(calls) > len(blocks)
                else f"called {len(calls)} of the {len(blocks)} blocks in {name}")
        raise CaptureError(f"cannot capture {type(model).__name__}: its forward {what}; trainplan needs each block "
                           "called once per forward, in order")
    if logits.dim() != 3 or logits.shape[1] != ids.shape[1]:
        raise CaptureError(f"cannot capture {type(model).__name__}: its forward returned logits of shape "
                           f"{tuple(logits.shape)} for token ids {tuple(ids.shape)}: trainplan needs logits for every "
                           "position, (b, s, V) (a nanoGPT forward returns the last position only when no targets "
                           "are given: return self.lm_head(x) for all positions)")
    structure = [(p, t, a) for p, t, a in zip(params, _tensor_structure(calls), _attribute_structure(blocks),
                                               strict=True)]
    layer_regions: list[str] = []
    block_regions: dict[str, int] = {}
    names: dict[tuple, str] = {}
    for i, sig in enumerate(structure):
        if sig not in names:
            names[sig] = f"block{len(names)}"
            block_regions[names[sig]] = i
        layer_regions.append(names[sig])
    for i in block_regions.values():  # a sample output for every region
        if i not in outputs:
            outputs[i] = with_hidden(next(iter(outputs.values())), hidden_of(calls[i].args, calls[i].kwargs)[0])
    hidden0, _ = hidden_of(calls[0].args, calls[0].kwargs)
    return Layout(blocks_name=name, blocks=blocks, calls=calls, layer_regions=layer_regions,
                  block_regions=block_regions, hidden_size=int(hidden0.shape[-1]),
                  vocab_size=int(logits.shape[-1]),
                  head_logits=bool(head_out) and head_out[-1] is logits, outputs=outputs)


def functional(model: nn.Module, tensors: dict[str, torch.Tensor], fn) -> Any:
    """`fn(model)` with `tensors` (by qualified name) in place of the model's parameters and
    buffers for all of `fn` (a forward and its backward, whose checkpoint recomputes read the
    parameters too); tied parameters stay tied (`torch.func.functional_call`)."""
    return torch.func.functional_call(Scope(model), {f"inner.{k}": v for k, v in tensors.items()}, (fn,),
                                      tie_weights=True, strict=False)


class Scope(nn.Module):
    """`inner` as a child, so `torch.func.functional_call(Scope(inner), {"inner.<name>": ...},
    (fn,))` runs `fn(inner)` with the given tensors in place for all of `fn`."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, fn):
        return fn(self.inner)


def config_int(model: nn.Module, *names: str) -> int | None:
    """The first of `names` the model's config (if any) has as an int."""
    cfg = getattr(model, "config", None)
    for n in names:
        v = getattr(cfg, n, None) if cfg is not None else None
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def module_int(model: nn.Module, *names: str) -> int | None:
    """The first of `names` found as an int attribute of any submodule (a nanoGPT attention's
    `n_head`)."""
    for m in model.modules():
        for n in names:
            v = vars(m).get(n)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    return None


SP_BLOCKING_FEATURES = ("sliding_window", "attn_logit_softcapping", "attention", "positions")
"""Features of `attention_features` that Ulysses attention (`trainplan.executor.parallel.ulysses`) cannot
run: a sliding window and softcapped scores (SDPA has neither), and attention the model computes
itself rather than through transformers' AttentionInterface (nothing to swap for Ulysses)."""


def attention_features(model: nn.Module, layout: Layout) -> tuple[str, ...]:
    """What the model's attention and head do beyond plain causal attention, as sorted
    `name=value` strings: `sliding_window=N` (the narrowest window any layer uses, from the
    attention modules' `sliding_window`, else the config's when `use_sliding_window` is not
    off), `layer_types=a/b` (alternating local and global layers), `attn_logit_softcapping=c`,
    `final_logit_softcapping=c`, `experts=E` and `experts_per_token=k` (mixture of experts),
    `attention=own` for a model whose attention is its own code (no transformers config, or a
    class that does not dispatch through transformers' AttentionInterface:
    `_supports_attention_backend` unset, e.g. Falcon, MPT, Bloom) and `positions=none` for a
    forward that takes no position ids (Bloom's ALiBi)."""
    cfg = getattr(model, "config", None)
    feats: dict[str, object] = {}
    mods = [m for b in layout.blocks for m in b.modules()]
    windows = [vars(m)["sliding_window"] for m in mods if "sliding_window" in vars(m)]
    if windows:
        window = min((w for w in windows if isinstance(w, int) and w > 0), default=None)
    else:
        window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) is not False else None
    if isinstance(window, int) and window > 0:
        feats["sliding_window"] = window
    types = getattr(cfg, "layer_types", None)
    if isinstance(types, (list, tuple)) and len(set(types)) > 1:
        feats["layer_types"] = "/".join(sorted(set(types)))
    caps = [vars(m)["attn_logit_softcapping"] for m in mods if "attn_logit_softcapping" in vars(m)]
    cap = next((c for c in caps if c), None) or getattr(cfg, "attn_logit_softcapping", None)
    if cap:
        feats["attn_logit_softcapping"] = cap
    final_cap = getattr(cfg, "final_logit_softcapping", None)
    if final_cap:
        feats["final_logit_softcapping"] = final_cap
    experts = config_int(model, "num_local_experts", "num_experts", "n_routed_experts")
    per_token = config_int(model, "num_experts_per_tok", "moe_topk")
    if experts and per_token is not None and not 1 <= per_token <= experts:
        raise TrainplanError(f"{type(model).__name__}'s config routes each token to num_experts_per_tok={per_token} "
                             f"of num_local_experts={experts} experts: give 1 <= num_experts_per_tok <= {experts}")
    if experts:
        feats["experts"] = experts
        feats["experts_per_token"] = per_token or 1
    if cfg is None or not hasattr(cfg, "_attn_implementation") \
            or not getattr(type(model), "_supports_attention_backend", False):
        feats["attention"] = "own"
    if not accepts_position_ids(model):
        feats["positions"] = "none"
    return tuple(sorted(f"{k}={v}" for k, v in feats.items()))


def sp_refusal(features: tuple[str, ...]) -> str:
    """Why Ulysses sequence parallelism cannot run a model with `features`, or "" when it can."""
    blocking = [f for f in features if f.split("=")[0] in SP_BLOCKING_FEATURES]
    if not blocking:
        return ""
    return (f"Ulysses sequence parallelism cannot run this model ({', '.join(blocking)}): it swaps in SDPA "
            "through transformers' AttentionInterface (no windows, no softcapping) and gives each rank its "
            "shard's position ids")
