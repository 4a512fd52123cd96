"""Checks behind the `trainplan` command line (`planner.cli.main`): output paths, `--device`
names and loaded plan files, each raising one `TrainplanError` subclass with a message
that names the bad value and what is valid; run before anything is written or trained.

torch, the executor and the model presets are imported inside the checks that need them: the
`trainplan` command starts without torch (`planner.cli.commands`).
"""

from __future__ import annotations

import math
from pathlib import Path

from costmodels.step.precision import optimizer_bits_for
from planner.plan import edited_layout
from trainplan_errors import DeviceError, OutputPathError, PlanMismatchError, TrainplanError, UnknownNameError

__all__ = ["check_device", "check_json_path", "check_loss_value", "check_out_dir", "check_plan", "check_plan_model",
           "valid_devices"]


def check_json_path(path: str | Path) -> Path:
    """Where `solve --json` may write: a file path whose folder exists.

    Raises:
        OutputPathError: the path is a folder, or its folder does not exist or is a file.
    """
    if not str(path):
        raise OutputPathError("--json is empty; give a file path such as plan.json")
    p = Path(path)
    if p.is_dir():
        raise OutputPathError(f"--json {str(p)!r} is a folder; give a file path such as "
                              f"{str(p / 'plan.json')!r}")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        what = "is a file" if parent.exists() else "does not exist"
        raise OutputPathError(f"--json {str(p)!r}: folder {str(parent)!r} {what}; create the folder "
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
    from executor.checkpoint import CHECKPOINT_DIR

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


def check_plan(plan, path: str | Path) -> None:
    """Check a loaded plan's fields before anything runs: types, ranges and the relations the
    executor relies on (sp_degree x dp_degree = devices, sp_degree divides seq_len, one
    checkpoint entry per layer). A plan written by `trainplan solve` always passes.

    Raises:
        PlanMismatchError: the first field that is wrong, with its value and what is valid.
    """
    d, p = plan.decisions, plan.predictions

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    mem = p.memory_bytes
    checks = [
        ("model", plan.model, isinstance(plan.model, str) and bool(plan.model.strip()), "a model name"),
        ("data_tokens", plan.data_tokens, _whole(plan.data_tokens, 1), "a whole number >= 1"),
        ("model_n_params", plan.model_n_params, _whole(plan.model_n_params, 1), "a whole number >= 1"),
        ("model_n_layers", plan.model_n_layers, _whole(plan.model_n_layers, 1), "a whole number >= 1"),
        ("vocab_size", plan.vocab_size, _whole(plan.vocab_size, 1), "a whole number >= 1"),
        ("decisions.devices", d.devices, _whole(d.devices, 1), "a whole number >= 1"),
        ("decisions.sp_degree", d.sp_degree, _whole(d.sp_degree, 1), "a whole number >= 1"),
        ("decisions.dp_degree", d.dp_degree, _whole(d.dp_degree, 1), "a whole number >= 1"),
        ("decisions.seq_len", d.seq_len, _whole(d.seq_len, 1), "a whole number >= 1"),
        ("decisions.micro_batch", d.micro_batch, _whole(d.micro_batch, 1), "a whole number >= 1"),
        ("decisions.grad_accum", d.grad_accum, _whole(d.grad_accum, 1), "a whole number >= 1"),
        ("decisions.max_steps", d.max_steps, _whole(d.max_steps, 1), "a whole number >= 1"),
        ("decisions.warmup_steps", d.warmup_steps, _whole(d.warmup_steps, 0), "a whole number >= 0"),
        ("decisions.seed", d.seed, _whole(d.seed, 0) and d.seed < 2**63, "a whole number in [0, 2^63)"),
        ("decisions.zero_stage", d.zero_stage, d.zero_stage in (0, 1, 2, 3), "0, 1, 2 or 3"),
        ("decisions.optimizer_bits", d.optimizer_bits,
         _whole(d.optimizer_bits, 1) and d.optimizer_bits in optimizer_bits_for(d.precision),
         f"one of {', '.join(map(str, optimizer_bits_for(d.precision)))} at precision {d.precision!r}"),
        ("decisions.activation_bits", d.activation_bits,
         _whole(d.activation_bits, 1) and d.activation_bits in (32, 16, 8), "32, 16 or 8"),
        ("decisions.precision", d.precision, d.precision in ("fp32", "bf16-mixed", "bf16"),
         "fp32, bf16-mixed or bf16"),
        ("decisions.data_fraction", d.data_fraction,
         isinstance(d.data_fraction, (int, float)) and 0 < d.data_fraction <= 1, "in (0, 1]"),
        ("decisions.data_method", d.data_method,
         d.data_method in ("random", "loss", "influence", "dsir"), "random, loss, influence or dsir"),
        ("decisions.selection_every_steps", d.selection_every_steps,
         _whole(d.selection_every_steps, 0), "a whole number >= 0"),
        ("decisions.lr", d.lr, number(d.lr) and d.lr > 0, "a positive finite number"),
        ("decisions.checkpoint_sets", d.checkpoint_sets, isinstance(d.checkpoint_sets, dict)
         and all(isinstance(k, str) and isinstance(v, list) and all(isinstance(x, str) for x in v)
                 for k, v in d.checkpoint_sets.items()),
         "an object of checkpoint entry name -> list of node keys"),
        ("budget", plan.budget, isinstance(plan.budget, dict), "an object of budget fields"),
        ("decisions.governor_threshold", d.governor_threshold,
         number(d.governor_threshold) and d.governor_threshold >= 0,
         "a finite number >= 0 (nats/step; 0: no governor)"),
        ("predictions.memory_bytes", mem, isinstance(mem, dict) and "total" in mem
         and all(number(v) and v >= 0 for v in mem.values()),
         "bytes by category, each a finite number >= 0, with a total"),
        ("predictions.step_time_s", p.step_time_s, number(p.step_time_s) and p.step_time_s > 0,
         "a positive finite number of seconds"),
    ]
    for name, value, ok, valid in checks:
        if not ok:
            raise PlanMismatchError(f"plan {str(path)!r}: {name}={value!r} must be {valid}; the plan "
                                    "file is corrupt or edited: solve it again")
    layout = edited_layout(plan)
    relations = [
        (d.sp_degree * d.dp_degree == d.devices,
         f"sp_degree={d.sp_degree} x dp_degree={d.dp_degree} must equal devices={d.devices}"),
        (d.warmup_steps <= d.max_steps,
         f"warmup_steps={d.warmup_steps} must be at most max_steps={d.max_steps} (a solved plan warms "
         "up over a tenth of its steps, at most 20)"),
        (d.seq_len % d.sp_degree == 0,
         f"sp_degree={d.sp_degree} must divide seq_len={d.seq_len}"),
        (len(d.checkpoint) == plan.model_n_layers and all(isinstance(c, str) for c in d.checkpoint),
         f"checkpoint has {len(d.checkpoint)} entries, must be one name per layer "
         f"({plan.model_n_layers})"),
        (layout is None, layout),
    ]
    for ok, what in relations:
        if not ok:
            raise PlanMismatchError(f"plan {str(path)!r}: {what}; the plan file is corrupt or edited: "
                                    "solve it again")


def check_plan_model(plan) -> None:
    """Check, before building anything, that `plan` names a preset whose parameter count (at
    the plan's vocabulary) is the plan's: a plan edited or made for another model is refused
    before a wrong (perhaps huge) model is built.

    Raises:
        PlanMismatchError: the plan's model is not a preset, or has another parameter count.
    """
    from modeling.presets import known_presets, preset_n_params

    try:
        n = preset_n_params(plan.model, vocab_size=plan.vocab_size)
    except UnknownNameError:
        raise PlanMismatchError(
            f"plan was made for model {plan.model!r}, which is not a preset ({', '.join(known_presets())}); "
            "`trainplan run` builds presets only: run it from Python with "
            "executor.run(plan, model, data)") from None
    if n != plan.model_n_params:
        raise PlanMismatchError(
            f"plan says model {plan.model} has {plan.model_n_params:,} parameters but preset "
            f"{plan.model} at vocab_size={plan.vocab_size} has {n:,}: the plan was made for another "
            "model or edited; solve it again")

