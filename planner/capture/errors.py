"""Capture failures that name their cause: the op and the module path where tracing a model on
fake tensors failed, and what to change, in one line (`capture_errors`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from trainplan.errors import CaptureError, TrainplanError
from trainplan.modeling.torch_private import DataDependentOutputException, DynamicOutputShapeException, OpOverload

_DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException)


def _failed_op(exc: BaseException) -> str:
    """The aten op the exception (or one it was raised from) came out of, or ""."""
    seen: set[int] = set()
    e: BaseException | None = exc
    found = ""
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        func = getattr(e, "func", None)
        if isinstance(func, OpOverload):
            return str(func)
        tb = e.__traceback__
        while tb is not None:
            owner = tb.tb_frame.f_locals.get("self")
            if isinstance(owner, OpOverload):
                found = str(owner)
            tb = tb.tb_next
        if found:
            return found
        e = e.__cause__ or e.__context__
    return found


def _advice(exc: BaseException, op: str) -> str:
    if isinstance(exc, _DATA_DEPENDENT) or "_local_scalar_dense" in op or "nonzero" in op:
        return ("it reads tensor values while tracing (data-dependent control flow: .item(), .tolist(), "
                "nonzero, branching on values); branch on shapes or config values instead")
    return ("the op cannot run on fake tensors as called; trainplan traces forward and backward on fake "
            "tensors at the dtypes it plans (fp32, bf16): make the module run there")


def _failed_module(exc: BaseException, names: dict[int, str]) -> nn.Module | None:
    """The innermost module of the model whose code was running when `exc` was raised (the
    last frame of its traceback whose `self` is one of the model's modules)."""
    found = None
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            found = owner
        tb = tb.tb_next
    return found


def _parents(name: str) -> list[str]:
    """`a.b.0.c` -> [`a`, `a.b`, `a.b.0`, `a.b.0.c`]."""
    parts = name.split(".")
    return [".".join(parts[:i + 1]) for i in range(len(parts))] if name else []


@contextlib.contextmanager
def capture_errors(model: nn.Module, what: str, before_blocks: bool = False) -> Iterator[None]:
    """Turn a failure inside the block into one `CaptureError` line: the model, `what` was being
    traced, the op, the innermost module running (its qualified name and class), the first line
    of torch's message and the advice. `before_blocks`: the block runs the model's whole forward,
    and a failure outside every block (no module of the blocks list running) is blamed on what
    the forward was given: token ids. `TrainplanError`s pass unchanged."""
    try:
        yield
    except TrainplanError:
        raise
    except Exception as e:
        names = {id(m): n for n, m in model.named_modules()}
        op = _failed_op(e)
        module = _failed_module(e, names)
        where = (f"in {names[id(module)] or '(root)'} ({type(module).__name__})" if module is not None
                 else "outside its modules")
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        in_blocks = module is not None and any(n.rsplit(".", 1)[-1].isdigit() for n in
                                               _parents(names[id(module)]))
        if before_blocks and not in_blocks:
            raise CaptureError(
                f"cannot capture {type(model).__name__}: its forward failed before its first block, at "
                f"{op or 'an op'} {where} ({type(e).__name__}: {first}); trainplan calls the forward with "
                "token ids (b, s) int64, as input_ids= or its first argument: give a model whose forward "
                "takes token ids and returns logits") from None
        raise CaptureError(
            f"cannot capture {type(model).__name__}: tracing {what} failed at {op or 'an op'} {where} with "
            f"{type(e).__name__}: {first}; {_advice(e, op)}") from None
