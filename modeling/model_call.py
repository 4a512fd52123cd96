"""Calling a user's causal LM on token ids, whatever its forward's signature, and taking the logits
from whatever it returns.

The model contract (issue #20): any `nn.Module` whose forward takes token ids and returns the
logits, as a tensor, an object with `.logits` (HF's `CausalLMOutput`), a tuple or list whose first
element is the logits (nanoGPT's `(logits, loss)`) or a dict with `"logits"`. `forward_logits`
calls a model that way; `forward_call` gives the arguments alone (for `torch.func.functional_call`).

How the ids are passed, read once per model class from its forward's signature
(`forward_signature`):

- `input_ids=` as a keyword when the forward has a parameter of that name, or takes keywords only
  (`**kwargs`); else positionally, as the first argument (`forward(self, idx, targets=None)`);
- `use_cache=False` only when the forward names `use_cache` (HF models: no KV cache is filled
  in a training forward, ops the plan did not capture);
- `position_ids=` only when the forward names `position_ids`. A forward that only takes
  `**kwargs` is not assumed to accept either.

Wrappers are seen through: of DDP (and DataParallel) and `torch.compile`'s module the wrapped
model's (`.module`, `._orig_mod`) forward is read, while the wrapper itself is called; FSDP2's
`FSDPModule` needs nothing, its class is a subclass of the model's whose `forward` is the original.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from trainplan.errors import CaptureError, PlanMismatchError


@dataclass(frozen=True)
class ForwardSignature:
    """What a model's forward accepts, as `forward_call` uses it."""

    ids_keyword: bool
    """Token ids go as `input_ids=` (else positionally, first)."""
    use_cache: bool
    """The forward names `use_cache` (it is then passed False)."""
    position_ids: bool
    """The forward names `position_ids`."""


_SIGNATURES: dict[type, ForwardSignature] = {}


def _inner(model: nn.Module) -> nn.Module:
    """The model that DDP, DataParallel or `torch.compile` wrap, through any number of wrappers."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = cast(nn.Module, model.module)
        elif type(model).__name__ == "OptimizedModule" and isinstance(orig := getattr(model, "_orig_mod", None),
                                                                      nn.Module):
            model = orig
        else:
            return model


def forward_signature(model: nn.Module) -> ForwardSignature:
    """How `model` (or the model a DDP / `torch.compile` wrapper holds) takes its inputs; cached
    per class, unless the instance has its own `forward`."""
    inner = _inner(model)
    own = "forward" in inner.__dict__
    if not own and type(inner) in _SIGNATURES:
        return _SIGNATURES[type(inner)]
    params = inspect.signature(inner.forward).parameters.values()
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    positional = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)
    sig = ForwardSignature(ids_keyword="input_ids" in named or not positional,
                           use_cache="use_cache" in named, position_ids="position_ids" in named)
    if not own:
        _SIGNATURES[type(inner)] = sig
    return sig


def forward_call(model: nn.Module, input_ids: Any, *,
                 position_ids: torch.Tensor | None = None) -> tuple[tuple, dict[str, Any]]:
    """(args, kwargs) that call `model` on `input_ids` (b, s) (`forward_signature`), with
    `position_ids` (b, s) or (1, s) when given.

    Raises:
        PlanMismatchError: `position_ids` given, the forward takes none, and they are not
            0..s-1 (a model that cannot take positions cannot run a sequence shard, so not
            under sequence parallelism).
    """
    sig = forward_signature(model)
    args: tuple = ()
    kwargs: dict[str, Any] = {}
    if sig.ids_keyword:
        kwargs["input_ids"] = input_ids
    else:
        args = (input_ids,)
    if sig.use_cache:
        kwargs["use_cache"] = False
    if position_ids is not None:
        if sig.position_ids:
            kwargs["position_ids"] = position_ids
        elif not _from_zero(position_ids):
            name = type(_inner(model)).__name__
            raise PlanMismatchError(
                f"{name}.forward takes no position_ids, so it cannot run a sequence shard at positions "
                f"{int(position_ids.min())}..{int(position_ids.max())} (sequence parallelism feeds each "
                f"rank its shard with global positions): give its forward a `position_ids` argument, or "
                f"plan with sp_degree=1")
    return args, kwargs


def _from_zero(position_ids: torch.Tensor) -> bool:
    s = position_ids.shape[-1]
    want = torch.arange(s, device=position_ids.device)
    return bool((position_ids == want).all())


def accepts_position_ids(model: nn.Module) -> bool:
    """The forward of `model` names `position_ids` (sequence parallelism needs it)."""
    return forward_signature(model).position_ids


def forward_logits(model: nn.Module, input_ids: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                   allow_scalar: bool = False) -> torch.Tensor:
    """The logits (b, s, V) of `model` on token ids `input_ids` (b, s) int64, called as its
    forward accepts (`forward_call`; `position_ids` (b, s) or (1, s) the tokens' positions).

    The output may be the logits, an object with `.logits`, a dict with `"logits"`, or a tuple or
    list whose first element is the logits. `allow_scalar`: a 0-dim result is returned as is (a
    tiled loss head, `trainplan.modeling.tiling.TiledHead`, makes the logits the summed cross-entropy).

    Raises:
        CaptureError: the output holds no logits (e.g. a 0-dim loss without `allow_scalar`), or
            logits not of shape (b, s, V); the message names what the model returned.
        PlanMismatchError: positions the model cannot take (`forward_call`).
    """
    args, kwargs = forward_call(model, input_ids, position_ids=position_ids)
    out = model(*args, **kwargs)
    logits = _logits_of(out)
    if isinstance(logits, torch.Tensor):
        if logits.ndim == 0 and allow_scalar:
            return logits
        if logits.ndim == 3 and tuple(logits.shape[:2]) == tuple(input_ids.shape):
            return logits
    name = type(_inner(model)).__name__
    raise CaptureError(
        f"{name} returned {_describe(out)} for token ids of shape {tuple(input_ids.shape)}; trainplan "
        f"expects the logits, one row per token, of shape (b, s, vocab) = ({input_ids.shape[0]}, "
        f"{input_ids.shape[-1]}, V): a tensor, an object with .logits, a dict with 'logits' or a tuple "
        f"whose first element is the logits")


def _logits_of(out: Any) -> Any:
    """What of a forward's output should be the logits (the output itself when it is a tensor)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):  # a dict, or HF's ModelOutput (an OrderedDict with attributes)
        return out.get("logits")
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)) and out:
        return out[0]
    return None


def _describe(out: Any) -> str:
    """A forward's output in a few words: a tensor's shape, what a container holds."""
    if isinstance(out, torch.Tensor):
        return f"a {out.ndim}-dim tensor of shape {tuple(out.shape)}" + (
            " (a loss? pass token ids only, or return the logits)" if out.ndim == 0 else "")
    if hasattr(out, "logits"):  # HF's ModelOutput, a Mapping too
        return f"a {type(out).__name__} whose .logits is {_describe(out.logits)}"
    if isinstance(out, Mapping):
        keys = ", ".join(map(repr, out.keys())) or "none"
        inner = f"; its 'logits' is {_describe(out['logits'])}" if "logits" in out else ""
        return f"a {type(out).__name__} (keys {keys}){inner}"
    if isinstance(out, (tuple, list)):
        return f"a {type(out).__name__} of {len(out)}" + (f" whose first element is {_describe(out[0])}" if out else "")
    return f"a {type(out).__name__}"
