"""`trainplan export PLAN --to torchtitan|deepspeed|accelerate [--out FILE]`: a plan as a
framework's native config, and what it cannot express.

Without `--out` the config goes to stdout alone (to pipe or redirect) and the unexpressed
decisions to stderr; with `--out` the file is written and stdout names it and lists them. The
mapping is `trainplan.planner.export`'s; this module parses, checks the output path, and prints.
"""

from __future__ import annotations

import sys
from pathlib import Path

from trainplan.errors import OutputPathError
from trainplan.planner.cli.checks import check_json_path
from trainplan.planner.export.common import Export
from trainplan.planner.export.targets import SUFFIXES, export_plan
from trainplan.planner.plan import Plan

__all__ = ["check_export_out", "cmd_export", "terminal_lines"]


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


def cmd_export(args) -> int:
    """`trainplan export`: read the plan, export it to `args.to`, write `args.out` or stdout.

    Raises:
        PlanMismatchError: the plan file cannot be read or is not a valid plan.
        OutputPathError: `--out` is not a writable file path.
        TrainplanError: the target cannot express the plan at all (`trainplan.planner.export.targets.export_plan`).
    """
    out = check_export_out(args.out, args.to) if args.out is not None else None
    e = export_plan(Plan.from_json(args.plan), args.to)
    if out is None:
        sys.stdout.write(e.text)
        sys.stdout.flush()
        for line in terminal_lines(e):
            print(f"trainplan: {line}", file=sys.stderr)
        return 0
    try:
        out.write_text(e.text)
    except OSError as err:
        raise OutputPathError(f"--out {args.out!r}: cannot write it ({err.strerror}); give a writable file "
                              "path") from None
    print(f"wrote {out}: {e.kind}")
    for line in terminal_lines(e):
        print(line)
    return 0
