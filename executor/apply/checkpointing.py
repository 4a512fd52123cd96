"""A plan's checkpoint sets on a user's model: its transformer blocks found (`find_blocks`), their
ops checked against the plan's captured ones (`check_block_ops`), and each checkpointed block's
forward run under torch's selective activation checkpointing (`apply_checkpointing`, `sac_forward`).

Checkpoint sets name op calls by position in a block's forward (`trainplan.costmodels.checkpoint_sets`:
`aten.mm.default#3` is the fourth `aten.mm` call), which names the intended ops only in the model
the plan captured. So before any block is wrapped, `check_block_ops` runs one forward of the
whole model on fake tensors (`FakeTensorMode`: no memory, no compute) with the parameter dtype and
autocast of the run, records each checkpointed layer's ops as the SAC policy function sees them
(a `TorchDispatchMode`, detach and torch's other SAC-ignored ops left out) and compares them, in
order, with the plan's `Decisions.checkpoint_block_ops`: the first op that differs is refused
with a `PlanMismatchError` naming the layer, the position, the op the plan expects and the op
found. The check is made when the plan is applied, not at the first training step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    set_checkpoint_early_stop,
)

from trainplan.costmodels.checkpoint_sets import (
    UNCOUNTED_OPS,
    CheckpointSet,
    KeyCounter,
    canonical_op,
    resolve,
    sets_from_mapping,
)
from trainplan.errors import PlanMismatchError, TrainplanError
from trainplan.modeling.fake_run import as_run
from trainplan.modeling.model_call import forward_call
from trainplan.modeling.torch_private import FakeTensorMode, TorchDispatchMode


def find_blocks(model: nn.Module, n_layers: int) -> tuple[str, nn.ModuleList]:
    """The model's transformer blocks: (qualified name, list) of its one `nn.ModuleList` of
    `n_layers` modules (a transformers causal LM's `model.layers`, or any other such list); when
    several lists have that length, the one holding the most parameters, as the capture picks it.

    Raises:
        PlanMismatchError: no list, or more than one candidate, of `n_layers` modules.
    """
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    found = [(name, m) for name, m in lists if len(m) == n_layers]
    if len(found) > 1:  # the capture's rule (`trainplan.planner.capture.layout.find_blocks`): the most parameters
        most = max(sum(p.numel() for p in m.parameters()) for _, m in found)
        found = [(n, m) for n, m in found if sum(p.numel() for p in m.parameters()) == most]
    if len(found) == 1:
        return found[0]
    have = ", ".join(f"{name or '(root)'} ({len(m)})" for name, m in lists) or "none"
    why = "several" if found else "no"
    raise PlanMismatchError(
        f"the plan has {n_layers} layers but {type(model).__name__} has {why} nn.ModuleList of {n_layers} "
        f"blocks (its module lists and lengths: {have}); apply the plan to the model it was made for, "
        "or solve one for this model (trainplan.planner.api.solve(model, ...))")


def sac_forward(orig, entry: CheckpointSet, *args, early_stop: bool = True, **kwargs):
    """Run `orig` under torch's selective activation checkpointing with `entry`'s saved set.

    The policy function names each op call of this forward by its node key (`KeyCounter`: the
    overload and its call count, as `trainplan.costmodels.checkpoint_sets.node_keys` names the captured forward's
    nodes) and answers MUST_SAVE for the keys `entry` keeps, MUST_RECOMPUTE otherwise (views
    and other ops that make no storage are never kept). torch calls the policy in the forward
    only and replays by call index, so a fresh counter per forward is the whole state."""

    def context_fn():
        counter = KeyCounter()

        def policy_fn(ctx, op, *a, **kw):
            if entry.saves(counter.key(str(op))):
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.MUST_RECOMPUTE

        return create_selective_checkpoint_contexts(policy_fn)

    with set_checkpoint_early_stop(early_stop):  # read when the checkpoint's frame is made
        return checkpoint(orig, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def apply_checkpointing(model: nn.Module, policies: Sequence[str], sets: Mapping[str, list[str]] | None = None,
                        *, blocks: nn.ModuleList | None = None, early_stop: bool = True) -> None:
    """Wrap each transformer block's forward in the checkpoint its entry names (parameter
    names are unchanged). `policies`: one entry per block (`Decisions.activation_checkpoint`); `sets`: the
    plan's `Decisions.checkpoint_sets`, the saved node keys of each solved entry (`remat:k`) that
    `policies` names; `blocks`: the blocks (None: `find_blocks(model, len(policies))`).
    `early_stop=False`: the recompute runs the whole forward (`set_checkpoint_early_stop`), as a
    block with a tiled MLP is modelled (`trainplan.costmodels.graph.Region.recompute_to_end`).

    Raises:
        PlanMismatchError: the model has no list of as many blocks as `policies` (or `blocks`
            has another length), or the plan names an entry it does not define.
    """
    layers = find_blocks(model, len(policies))[1] if blocks is None else blocks
    if len(layers) != len(policies):
        raise PlanMismatchError(f"plan has checkpoint choices for {len(policies)} layers, "
                                f"the model has {len(layers)}")
    known = sets_from_mapping(sets)
    for layer, policy in zip(layers, policies, strict=True):
        try:
            entry = resolve(policy, known)
        except TrainplanError as e:
            raise PlanMismatchError(str(e)) from None
        if entry.checkpointed:
            layer.forward = partial(sac_forward, layer.forward, entry, early_stop=early_stop)


class _OpRecorder(TorchDispatchMode):
    """Records the ops dispatched while `ops` is a list, named as node keys name them."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.ops is not None and func not in SAC_IGNORED_OPS and str(func) not in UNCOUNTED_OPS:
            self.ops.append(canonical_op(str(func)))
        return func(*args, **(kwargs or {}))


def block_ops(model: nn.Module, blocks: nn.ModuleList, layers: Sequence[int], *, seq_len: int,
              device: torch.device, param_dtype: torch.dtype | None = None,
              autocast_dtype: torch.dtype | None = None, micro_batch: int = 1) -> dict[int, list[str]]:
    """The ops each of `layers` (indices into `blocks`) runs in one forward of `model` on token
    ids of shape (`micro_batch`, `seq_len`) without a KV cache (the run's: a reshape that is a view
    at one batch size copies at another), in order, as the SAC policy function sees them (canonical op
    names, `trainplan.costmodels.checkpoint_sets.canonical_op`). Runs on fake tensors on `device`
    (`FakeTensorMode`: nothing allocated, nothing computed), floating parameters at `param_dtype`
    (None: their own), under `torch.autocast(device.type, autocast_dtype)` when given. A layer
    the forward does not reach maps to []. Masks are made as a training step makes them
    (`trainplan.modeling.fake_run.as_run`), as the capture makes them (`trainplan.planner.capture.layout`)."""
    recorder = _OpRecorder()
    got: dict[int, list[str]] = {i: [] for i in layers}

    def start(i, module, args, kwargs):
        recorder.ops = got[i]

    def stop(module, args, output):
        recorder.ops = None

    hooks = [h for i in layers for h in (blocks[i].register_forward_pre_hook(partial(start, i), with_kwargs=True),
                                         blocks[i].register_forward_hook(stop))]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with mode:
            state: dict[str, Any] = {
                k: torch.empty(v.shape, device=device, requires_grad=v.requires_grad,
                               dtype=param_dtype if param_dtype is not None and v.is_floating_point() else v.dtype)
                for k, v in model.named_parameters()}
            ids = torch.zeros(micro_batch, seq_len, dtype=torch.long, device=device)
        args, kwargs = forward_call(model, ids)  # as its forward takes ids (no KV cache where it has one)
        cast = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
                else contextlib.nullcontext())
        with mode, as_run(), recorder, cast:
            torch.func.functional_call(model, state, args, kwargs, strict=False)
    finally:
        for h in hooks:
            h.remove()
    return got


LAYOUT_OPS = frozenset(f"aten.{op}.{overload}" for op, overload in (
    ("view", "default"), ("_unsafe_view", "default"), ("reshape", "default"), ("clone", "default"),
    ("expand", "default"), ("t", "default"), ("transpose", "int"), ("permute", "default"),
    ("unsqueeze", "default"), ("squeeze", "dim"), ("alias", "default"), ("_to_copy", "default"),
    ("lift_fresh", "default"), ("lift_fresh_copy", "default")))
"""Ops that move or re-view data without computing: whether a reshape is a view or a copy
depends on the strides at the run's batch size (a size-1 batch is contiguous where a larger one
is not; a constant is lifted with a copy under tracing and without one eagerly), so the op
check leaves them out; no checkpoint set saves them."""


def check_block_ops(expected: Mapping[str, Mapping[str, Any]], got: Mapping[int, list[str]],
                    blocks_name: str) -> None:
    """Compare each checkpointed layer's ops (`got`, from `block_ops`) with the plan's
    (`Decisions.checkpoint_block_ops`: per block kind its `layers` and `ops`), both without
    `LAYOUT_OPS`; `blocks_name`: the blocks' qualified name in the model, for the message.

    Raises:
        PlanMismatchError: the first layer whose ops differ, with the position (0-based, within
            the layer's forward), the op the plan expects there and the op the model runs (or
            `the end of the block` when one sequence is shorter).
    """
    for kind, entry in expected.items():
        want = [op for op in entry["ops"] if op not in LAYOUT_OPS]
        for i in entry["layers"]:
            seen = [op for op in got.get(i, []) if op not in LAYOUT_OPS]
            k = next((k for k, (a, b) in enumerate(zip(want, seen, strict=False)) if a != b), min(len(want), len(seen)))
            if k == len(want) == len(seen):
                continue
            end = "the end of the block"
            exp, found = (want[k] if k < len(want) else end), (seen[k] if k < len(seen) else end)
            raise PlanMismatchError(
                f"{blocks_name}.{i} is not the block the plan was captured from ({kind}, "
                f"{len(want)} ops): compute op {k} of its forward is {found}, the plan expects {exp}; its "
                "checkpoint set would save other ops than planned: solve the plan for this model "
                "(trainplan.planner.api.solve(model, ...))")
