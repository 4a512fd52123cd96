"""Checks behind the `trainplan` command line (`trainplan.planner.cli.main`): output paths, `--device`
names, loaded plan files and the flags that change a plan (`--lr`, `--warmup-steps`), each
raising one `TrainplanError` subclass with a message that names the bad value and what is
valid; run before anything is written or trained.

torch, the executor and the model presets are imported inside the checks that need them: the
`trainplan` command starts without torch (`trainplan.planner.cli.commands`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from trainplan.costmodels.loss.planned import lr_warning
from trainplan.errors import DeviceError, OutputPathError, PlanMismatchError, TrainplanError, UnknownNameError
from trainplan.planner.plan import Plan
from trainplan.planner.plan_schema import LR_MAX

__all__ = ["check_device", "check_json_path", "check_loss_value", "check_out_dir", "check_plan_model",
           "check_schedule", "plan_from_data", "valid_devices", "with_schedule"]


def check_json_path(path: str | Path, *, option: str = "--json", example: str = "plan.json") -> Path:
    """Where `solve --json` (or another `option` naming an output file, e.g. `export --out`) may
    write: a file path whose folder exists; `example` is the file name the message suggests.

    Raises:
        OutputPathError: the path is empty or a folder, or its folder does not exist or is a file.
    """
    if not str(path):
        raise OutputPathError(f"{option} is empty; give a file path such as {example}")
    p = Path(path)
    if p.is_dir():
        raise OutputPathError(f"{option} {str(p)!r} is a folder; give a file path such as "
                              f"{str(p / example)!r}")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        what = "is a file" if parent.exists() else "does not exist"
        raise OutputPathError(f"{option} {str(p)!r}: folder {str(parent)!r} {what}; create the folder "
                              "or give a path in an existing one")
    return p


def check_out_dir(out: str | Path, *, option: str = "--out", resume: bool = False,
                  overwrite: bool = True) -> Path:
    """A run or report folder: not a file (nor under one), creatable if missing (tried, then
    removed again); with `overwrite=False`, not a folder that already holds a run (record.json
    or checkpoints) unless `resume`.

    Raises:
        OutputPathError: the path or a folder above it is a regular file; a run is there and
            neither --resume nor --overwrite was given; or the folder cannot be created.
    """
    from trainplan.executor.checkpoint import CHECKPOINT_DIR

    if not str(out):
        raise OutputPathError(f"{option} is empty; give a folder path (it is created if missing)")
    p = Path(out)
    for q in (p, *p.parents):
        if q.exists():
            if not q.is_dir():
                where = "is a file" if q == p else f"is under {str(q)!r}, which is a file"
                raise OutputPathError(f"{option} {str(p)!r} {where}; give a folder path (it is "
                                      "created if missing)")
            break
    if not (resume or overwrite) and p.is_dir():
        held = [n for n in ("record.json", CHECKPOINT_DIR) if (p / n).exists()]
        if held:
            raise OutputPathError(
                f"{option} {str(p)!r} already holds a run ({', '.join(held)}); continue it with "
                "--resume, replace it with --overwrite, or choose another --out")
    if not p.exists():  # a folder that cannot be made fails here, not after the build
        top = next(q for q in (*reversed(p.parents), p) if not q.exists())
        try:
            top.mkdir()
            top.rmdir()
        except OSError as e:
            raise OutputPathError(f"{option} {str(p)!r}: cannot create the folder: {e.strerror}; "
                                  "give a folder path in a writable place") from None
    return p


def check_loss_value(value: float | None) -> None:
    """`--loss-value-device-hours-per-nat`: None (no governor) or a finite number > 0.

    Raises: TrainplanError naming the flag and the value."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise TrainplanError(f"--loss-value-device-hours-per-nat {value!r}: give a finite number > 0 "
                             "(device-hours one nat less held-out loss is worth)")


def check_schedule(lr: float | None, warmup_steps: int | None) -> None:
    """`--lr`: None (the plan's) or a finite number in (0, `LR_MAX`]; `--warmup-steps`: None (the plan's) or a
    whole number >= 0.

    Raises: TrainplanError naming the flag and the value."""
    if lr is not None and not (isinstance(lr, (int, float)) and math.isfinite(lr) and 0 < lr <= LR_MAX):
        raise TrainplanError(f"--lr {lr!r}: give the peak learning rate, a finite number in (0, {LR_MAX:g}] "
                             "(e.g. 3e-3; LLM peaks are 1e-4 to 1e-2)")
    if warmup_steps is not None and not _whole(warmup_steps, 0):
        raise TrainplanError(f"--warmup-steps {warmup_steps!r}: give a whole number of optimizer steps >= 0 "
                             "(0: no warmup)")


def with_schedule(plan: Plan, *, lr: float | None = None, warmup_steps: int | None = None) -> Plan:
    """`plan` with its peak learning rate and warmup steps replaced where given (None keeps the
    plan's), a note saying so; `plan` itself when nothing changes.

    Raises: TrainplanError: `check_schedule`'s, or more warmup steps than the plan has steps."""
    check_schedule(lr, warmup_steps)
    d = plan.decisions
    new: dict[str, Any] = {k: v for k, v in (("lr", lr), ("warmup_steps", warmup_steps))
                           if v is not None and v != getattr(d, k)}
    if not new:
        return plan
    if new.get("warmup_steps", 0) > d.max_steps:
        raise TrainplanError(f"--warmup-steps {warmup_steps}: the plan has {d.max_steps:,} optimizer steps; "
                             f"give at most {d.max_steps:,}")
    note = "; ".join(f"{k}={v:g} set by --{k.replace('_', '-')} (solved: {getattr(d, k):g})" for k, v in new.items())
    warning = lr_warning(lr, plan.compute_flops) if lr is not None else ""
    return dataclasses.replace(plan, decisions=dataclasses.replace(d, **new), notes=(*plan.notes, note),
                               warnings=(*plan.warnings, warning) if warning else plan.warnings)


def plan_from_data(plan: str | None, data: list[str] | None) -> tuple[str | None, list[str] | None]:
    """`run --data A.txt B/ PLAN.json`: argparse reads PLAN as one more `--data` path. A corpus
    path is a .txt or .jsonl file or a folder, never a .json file, so when PLAN is missing and
    the last `--data` path ends in `.json`, it is PLAN. Returns (plan, data) so mended; else as
    given."""
    if plan is None and data and str(data[-1]).lower().endswith(".json"):
        return data[-1], data[:-1] or None
    return plan, data


def valid_devices() -> list[str]:
    """Device names `--device` accepts on this machine: cpu, and cuda, cuda:0, ... when torch
    sees CUDA/ROCm devices."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ["cpu"] + (["cuda"] + [f"cuda:{i}" for i in range(n)] if n else [])


def check_device(name: str | None) -> None:
    """Check a `--device` override before anything runs (None: the plan's device).

    Raises:
        DeviceError: not a torch device name, a device type the executor does not run on, or a
            device this machine does not have; the message lists the valid ones.
    """
    if name is None:
        return
    import torch

    valid = valid_devices()
    n = sum(v.startswith("cuda:") for v in valid)
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise DeviceError(f"--device {name!r} is not a device name; valid here: "
                          f"{', '.join(valid)}") from None
    if dev.type == "cpu":
        if dev.index:  # torch takes cpu:5 and runs on the one cpu device
            raise DeviceError(f"--device {name!r}: the cpu is one device (cpu or cpu:0); valid here: "
                              f"{', '.join(valid)}")
        return
    if dev.type == "cuda":
        if n == 0:
            raise DeviceError(f"--device {name!r}: torch sees no CUDA/ROCm device here; valid here: "
                              f"{', '.join(valid)}")
        if dev.index is None or dev.index < n:
            return
        raise DeviceError(f"--device {name!r}: this machine has {n} CUDA/ROCm device(s); valid "
                          f"here: {', '.join(valid)}")
    raise DeviceError(f"--device {name!r}: trainplan runs on cpu or cuda devices; valid here: "
                      f"{', '.join(valid)}")


def _whole(v, lo: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def check_plan_model(plan) -> None:
    """Check, before building anything, that `plan` names a preset, or holds the transformers
    config (`Plan.hf_config`) of a model, whose parameter count (at the plan's vocabulary, counted
    on the meta device) is the plan's: a plan edited or made for another model is refused before a
    wrong (perhaps huge) model is built.

    Raises:
        PlanMismatchError: the plan's model is neither a preset nor a config it holds, or has
            another parameter count, or its config cannot be built (the message says why).
    """
    from trainplan.modeling.presets import known_presets, preset_n_params

    if plan.hf_config is not None:
        from trainplan.modeling.configs import config_n_params

        try:
            n = config_n_params(plan.hf_config, vocab_size=plan.vocab_size)
        except TrainplanError as e:
            raise PlanMismatchError(f"plan's hf_config: {e}; the plan file is corrupt or edited: solve it "
                                    "again") from None
        if n != plan.model_n_params:
            raise PlanMismatchError(
                f"plan says model {plan.model} has {plan.model_n_params:,} parameters but its hf_config at "
                f"vocab_size={plan.vocab_size} builds {n:,}: the plan was edited, or made with another "
                "transformers version; solve it again")
        return
    try:
        n = preset_n_params(plan.model, vocab_size=plan.vocab_size)
    except UnknownNameError:
        raise PlanMismatchError(
            f"plan was made for model {plan.model!r}, which is not a preset ({', '.join(known_presets())}); "
            "`trainplan run` builds presets, and models from the config a plan holds (`trainplan solve --model "
            "config.json`), only: run it from Python with trainplan.executor.run(plan, model, data)") from None
    if n != plan.model_n_params:
        raise PlanMismatchError(
            f"plan says model {plan.model} has {plan.model_n_params:,} parameters but preset "
            f"{plan.model} at vocab_size={plan.vocab_size} has {n:,}: the plan was made for another "
            "model or edited; solve it again")


def parse_bits(flag: str, text: str | None) -> tuple[int, ...] | None:
    """`32,8` -> (32, 8); None stays None; a width given twice counts once (`8,8` -> (8,)).

    Raises:
        TrainplanError: not a comma-separated list of whole numbers (the value and flag named)."""
    if text is None:
        return None
    try:
        out = tuple(int(x) for x in str(text).split(","))
    except ValueError:
        out = ()
    if not out:
        raise TrainplanError(f"{flag} {text!r} is not a comma-separated list of bit widths, e.g. 32,8")
    return tuple(dict.fromkeys(out))


def memory_limit_bytes(gib: float | None) -> float | None:
    """`--memory-limit-gib` in bytes per device (None: the profile's usable memory, `hbm_bytes -
    memory_reserve_bytes`).

    Raises: TrainplanError for a value that is not a finite number > 0."""
    if gib is None:
        return None
    if not math.isfinite(gib) or gib <= 0:
        raise TrainplanError(f"--memory-limit-gib {gib!r}: give the per-device memory cap for tensors, a finite "
                             "number of GiB > 0 (e.g. 70 on an 80 GiB GPU, to leave headroom for fragmentation)")
    return gib * 2**30
