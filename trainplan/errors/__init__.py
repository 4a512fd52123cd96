"""Typed errors shared by every trainplan package.

This package is the bottom of the import graph (`planner`, `executor` -> `modeling` ->
`costmodels` -> `hardware_profiles` -> `trainplan.errors`; the import-linter contract in
pyproject.toml) and imports nothing of trainplan, so every package can raise these errors and
imports them from here. The CLI catches `TrainplanError`, prints its message on one line and
exits with status 2 (bad input), 3 (`InfeasibleError`) or 1 (a run that failed:
`TrainingDivergedError`, out of memory, a dead worker); `trainplan.planner.cli.main.EXIT_CODES`.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class TrainplanError(ValueError):
    """Base class: bad input or an outcome the user must act on. The message names the value
    and what would be valid."""


class UnknownNameError(TrainplanError, KeyError):
    """A hardware profile, model preset or other name that is not known."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return str(self.args[0]) if self.args else ""


class InfeasibleError(TrainplanError):
    """No choice of knobs satisfies the budget; the message names the binding term with both
    numbers and what to relax.

    The planner sets, where it knows them (absent otherwise, `getattr(err, name, None)`):"""

    binding: str
    """What binds: "time limit" (the solver stopped before any plan, `trainplan.planner.joint.solver`), or,
    once explained (`trainplan.planner.joint.explain`), "memory", "budget" or "memory and budget"."""
    explanation: object
    """The diagnosis, a `trainplan.planner.joint.explain.Explanation`."""
    suggestions: tuple[object, ...]
    """The changes that fit, smallest first: `trainplan.planner.joint.explain.Suggestion`s."""
    solver_message: str
    """The solver's own message, before the explanation replaced it."""


class PlanMismatchError(TrainplanError):
    """A plan applied to a model, corpus or hardware it was not made for, or a corrupt plan file."""


class DataError(TrainplanError):
    """A corpus that is empty, unreadable, not UTF-8 or too small for one sequence."""


class TrainingDivergedError(TrainplanError):
    """The loss became NaN or infinite during a run."""


class BudgetError(TrainplanError):
    """A budget or solver limit that is not a positive finite number in range (time limit, data
    tokens, a budget above its stated maximum, more devices than any plan can use)."""


class OutputPathError(TrainplanError):
    """An output path that cannot be written (a missing folder, a folder where a file is
    expected or a file where a folder is), or a run folder that would be overwritten."""


class ExportMemoryError(TrainplanError):
    """An exported config whose substitutes for what the framework cannot express (fp32 AdamW for
    8-bit Adam, no checkpointing for per-block sets, ...) no longer fit the device's memory; the
    message gives the re-priced and the planned bytes and the limit (`trainplan export`)."""


class DeviceError(TrainplanError):
    """A torch device that is not a device name or is not present on this machine."""


class ModelConfigError(TrainplanError):
    """A model config (a transformers `config.json`) that cannot be read or built: a missing file,
    not JSON, no `model_type`, a type transformers does not know or that is not a causal LM."""


class CaptureError(TrainplanError):
    """A model that cannot be captured as a graph (not a causal LM of the supported layout, or
    its forward/backward cannot be traced, e.g. data-dependent control flow)."""


class UnsafeFileError(TrainplanError):
    """A file trainplan loads (a run folder's checkpoint: optimizer state, RNG states, DCP metadata
    and its non-tensor items) that holds more than data: a pickle naming a class or function outside
    the allowed ones, which loading would call (`trainplan.executor.safe_load`)."""


class MissingExtraError(TrainplanError):
    """An optional dependency that is not installed: the message names the package, what needs
    it and the extra that installs it, e.g. "8-bit AdamW needs bitsandbytes, which is not
    installed: pip install 'trainplan[run]' (No module named 'bitsandbytes')". The base install
    plans; `[run]` adds what a training run needs, `[demo]` the demo's corpus (pyproject.toml)."""


def require_extra(module: str, extra: str, needed_for: str) -> ModuleType:
    """Import the optional `module` (e.g. "bitsandbytes") of the extra `extra` ("run", "demo")
    where `needed_for` (e.g. "8-bit AdamW") needs it.

    Raises:
        MissingExtraError: the module cannot be imported; names it, `needed_for` and the
            install command `pip install 'trainplan[<extra>]'`.
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        package = module.split(".")[0]
        why = (str(err).splitlines() or [type(err).__name__])[0]
        raise MissingExtraError(f"{needed_for} needs {package}, which is not installed: "
                                f"pip install 'trainplan[{extra}]' ({why})") from err
