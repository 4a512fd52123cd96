"""`trainplan export PLAN --to torchtitan|deepspeed|accelerate [--out FILE] [--force]`: a plan as a
framework's native config, and what it cannot express.

Without `--out` the config goes to stdout alone (to pipe or redirect) and the unexpressed
decisions to stderr; with `--out` the file is written and stdout names it and lists them; `-q`
prints neither (errors only; the config still goes to stdout without `--out`). When the file runs
layout decisions other than the plan's (8-bit Adam as fp32 AdamW, ...), the memory is re-checked
with them (`trainplan.planner.export.repricing`): a file that no longer fits is refused with one
line giving both numbers (`ExportMemoryError`, exit 2), unless `--force`. The mapping is
`trainplan.planner.export`'s; this module parses, checks the output path, and prints.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from trainplan.errors import ExportMemoryError, OutputPathError, PlanMismatchError, TrainplanError
from trainplan.planner.cli.checks import check_json_path
from trainplan.planner.export.common import Export
from trainplan.planner.export.repricing import reprice
from trainplan.planner.export.targets import SUFFIXES, TARGETS, export_plan
from trainplan.planner.plan import Plan

__all__ = ["check_export_out", "cmd_export", "export_flags", "terminal_lines"]


def export_flags(x) -> None:
    """The arguments of `trainplan export` on its parser `x`."""
    x.add_argument("plan", metavar="PLAN", help="plan JSON from `trainplan solve --json`")
    x.add_argument("--to", required=True, choices=tuple(TARGETS),
                   help="the framework: torchtitan (0.2.2 job TOML), deepspeed (0.19.8 config JSON), "
                        "accelerate (1.15 config YAML plus the plugin settings as comments)")
    x.add_argument("--out", metavar="FILE",
                   help="write the config to FILE and list the unexpressed decisions on stdout (default: the "
                        "config on stdout, the list on stderr)")
    x.add_argument("--hw", metavar="FILE.toml",
                   help="the profile file the plan was solved with (`solve --hw FILE.toml`), whose name the plan "
                        "holds: read for its devices per node and to re-check the memory")
    x.add_argument("--force", action="store_true",
                   help="write the config even when what the framework runs instead of the plan's settings "
                        "(e.g. fp32 AdamW for 8-bit Adam) no longer fits the device's memory")


def check_export_out(path: str, to: str) -> Path:
    """Where `export --out` may write: a file path whose folder exists (an existing file is
    replaced).

    Raises:
        OutputPathError: the path is empty or a folder, or its folder does not exist or is a file.
    """
    return check_json_path(path, option="--out", example=f"{to}{SUFFIXES[to]}")


def terminal_lines(e: Export) -> list[str]:
    """The unexpressed decisions as `trainplan export` prints them: a count, then one line each."""
    if not e.not_expressed:
        return [f"{e.target} expresses every decision of the plan"]
    return [f"{e.target} cannot express {len(e.not_expressed)} decision(s) of the plan; the file uses instead:",
            *(f"  - {n.line()}" for n in e.not_expressed)]


def with_profile_file(plan: Plan, hw: str | None) -> Plan:
    """`plan` with its `hw` replaced by the profile file `hw` (`export --hw FILE.toml`), so that the
    export and its memory re-check load the profile the plan was solved with; `plan` when `hw` is None.

    Raises:
        TrainplanError: the file cannot be read as a profile (`trainplan.hardware_profiles.load`).
        PlanMismatchError: the file's profile is not the one the plan names.
    """
    if hw is None:
        return plan
    from trainplan.hardware_profiles import load

    name = load(hw).name
    if name != plan.hw:
        raise PlanMismatchError(f"--hw {hw!r} is profile {name!r} but the plan was made for {plan.hw!r}: give the "
                                "profile file the plan was solved with, or leave --hw out for a shipped profile")
    return dataclasses.replace(plan, hw=hw)


def cmd_export(args) -> int:
    """`trainplan export`: read the plan, export it to `args.to`, write `args.out` or stdout.

    Raises:
        PlanMismatchError: the plan file cannot be read or is not a valid plan.
        OutputPathError: `--out` is not a writable file path.
        ExportMemoryError: the file's substituted settings do not fit the device (without `--force`).
        TrainplanError: the target cannot express the plan at all (`trainplan.planner.export.targets.export_plan`),
            or its memory cannot be re-checked (`trainplan.planner.export.repricing.reprice`; without `--force`).
    """
    out = check_export_out(args.out, args.to) if args.out is not None else None
    plan = with_profile_file(Plan.from_json(args.plan), getattr(args, "hw", None))
    e = export_plan(plan, args.to)
    quiet, force = bool(getattr(args, "quiet", False)), bool(getattr(args, "force", False))
    notes = [] if quiet else terminal_lines(e)
    try:
        repriced = reprice(plan, e)
    except TrainplanError as err:
        if not force:
            raise
        repriced = None
        if not quiet:
            notes.append(f"memory not re-checked (--force): {err}")
    if repriced is not None and not repriced.fits and not force:
        raise ExportMemoryError(f"{repriced.line()}; change the plan (e.g. `trainplan solve` with what {e.target} "
                                "runs), or --force to write the file anyway")
    if repriced is not None and not quiet:
        notes.append(f"memory re-checked: {repriced.line()}" + ("" if repriced.fits else " (written: --force)"))
    if out is None:
        sys.stdout.write(e.text)
        sys.stdout.flush()
        for line in notes:
            print(f"trainplan: {line}", file=sys.stderr)
        return 0
    try:
        out.write_text(e.text)
    except OSError as err:
        raise OutputPathError(f"--out {args.out!r}: cannot write it ({err.strerror}); give a writable file "
                              "path") from None
    if not quiet:
        print(f"wrote {out}: {e.kind}")
    for line in notes:
        print(line)
    return 0
