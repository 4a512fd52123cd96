"""The Pareto frontier's files for the command line: `frontier.csv` (the table of
`trainplan.planner.joint.frontier`, read by `trainplan.executor.reporting.figures.frontier_frame` and the run report)
and `frontier.png` (`trainplan.executor.reporting.figures.frontier_figure`), written by `trainplan solve
--frontier` and `trainplan demo` and copied into a run's folder by `trainplan run`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import pandas as pd

from trainplan.errors import OutputPathError
from trainplan.planner.joint.frontier import Frontier, format_frontier


def write_frontier(fr: Frontier | pd.DataFrame, out: str | Path) -> dict[str, Path]:
    """Write `frontier.csv` and `frontier.png` (`trainplan.executor.reporting.figures.frontier_figure`) into the
    folder `out` (created). Returns their paths under `csv` and `png`.

    Raises:
        OSError: `out` cannot be written."""
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:  # switching under a live pyplot closes its figures
        matplotlib.use("Agg")
    # imported once the backend is chosen (the figures module draws with matplotlib)
    from trainplan.executor.reporting.figures import frontier_figure

    table = fr.table if isinstance(fr, Frontier) else fr
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / "frontier.csv", "png": out / "frontier.png"}
    table.to_csv(paths["csv"], index=False)
    frontier_figure(table).savefig(paths["png"], dpi=110, metadata={"Software": None})
    return paths


def write_frontier_files(args: argparse.Namespace, fr: Frontier, json_path: Path | None) -> None:
    """`solve --frontier`: print the frontier, write frontier.csv/.png into --frontier-out, else
    beside the plan JSON (where `trainplan run` finds it), else ./frontier/.

    Raises:
        OutputPathError: the folder cannot be written."""
    where = Path(args.frontier_out) if args.frontier_out else (
        json_path.parent if json_path is not None else Path.cwd() / "frontier")
    print(f"Pareto frontier: {len(fr.table)} plans of {fr.solved} solved in {fr.wall_s:.1f} s "
          "(memory, device-hours, predicted loss; * the plan above)")
    print(format_frontier(fr.table))
    try:
        files = write_frontier(fr, where)
    except OSError as e:
        raise OutputPathError(f"--frontier-out {str(where)!r}: cannot write: {e.strerror}") from None
    print(f"frontier written to {files['csv']} and {files['png']}")


def copy_frontier(plan_path: Path, out: Path) -> None:
    """A frontier.csv beside the plan JSON goes into the run folder `out` (the report draws it)."""
    src = plan_path.parent / "frontier.csv"
    if src.is_file() and src.resolve() != (out / "frontier.csv").resolve():
        shutil.copyfile(src, out / "frontier.csv")
