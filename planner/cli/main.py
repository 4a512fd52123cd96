"""`trainplan` command line: solve, run, report, demo, profiles, calibrate.

Thin by design: each command parses, calls the library, prints. Bad input (any
`TrainplanError`) prints one line `trainplan: error: ...` and exits with status 2.
"""

from __future__ import annotations

import argparse
import re
import sys

from planner.cli.commands import (
    DATA_METHODS_HELP,
    DEFAULT_DATA_METHODS,
    DEMO_BUDGET_FLOPS,
    cmd_calibrate,
    cmd_demo,
    cmd_profiles,
    cmd_report,
    cmd_run,
    cmd_solve,
)
from trainplan_errors import TrainplanError


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (`trainplan: error: ...`, exit status 2, like every
    other bad input) that read negative numbers in any spelling (`--seq-len -5`,
    `--budget-seconds -1e3`, `-inf`) as values, so the checks behind them name the value."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(
            r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$", re.IGNORECASE)

    def error(self, message: str):
        sub = self.prog.split(" ", 1)[1] + ": " if " " in self.prog else ""
        if "expected one argument" in message:
            message += " (a value that starts with '-' is written OPTION=VALUE)"
        self.exit(2, f"trainplan: error: {sub}{message}; see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="trainplan", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)

    s = sub.add_parser("solve", help="plan a training run and print it")
    s.add_argument("--model", required=True, help="preset name, e.g. llama3-70b, tiny-llama")
    s.add_argument("--hw", required=True, help="hardware profile, e.g. mi300, h100, cpu, or a profile file "
                                                "./my-gpu.toml (`trainplan profiles --template h100` writes one)")
    s.add_argument("--devices", type=int, default=1)
    s.add_argument("--seq-len", type=int, default=2048)
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--budget-device-hours", type=float)
    g.add_argument("--budget-seconds", type=float, help="wall-clock seconds")
    g.add_argument("--budget-flops", type=float)
    s.add_argument("--data-tokens", type=int, help="unique tokens in the corpus (default: unconstrained)")
    s.add_argument("--global-batch-tokens", type=int, metavar="N",
                   help="tokens per optimizer step, all devices together (e.g. 4194304): every plan "
                        "trains exactly N (dp_degree x micro_batch x seq_len x grad_accum), the solver "
                        "setting gradient accumulation with the micro-batch (default: grad_accum 1)")
    s.add_argument("--json", help="write the plan to this file")
    s.add_argument("--time-limit", type=float, default=10.0,
                   help="solver time limit in CP-SAT deterministic seconds (reproducible: same inputs and "
                        "seed, same plan); default 10")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--frontier", action="store_true",
                   help="also solve a ladder of budgets and memory caps and print the Pareto "
                        "frontier (memory, device-hours, predicted loss); writes frontier.csv "
                        "and frontier.png")
    s.add_argument("--frontier-out", metavar="DIR",
                   help="folder for frontier.csv/.png (default: beside --json, else ./frontier)")
    s.add_argument("--loss-value-device-hours-per-nat", type=float, metavar="V", help=(
        "turn the compute governor on: one nat less held-out loss is worth V device-hours; "
        "it stops the run once a step's predicted loss drop is worth less than its cost"))
    s.add_argument("--heldout-curve", metavar="FILE", help=(
        "a held-out curve calibrated on pilot runs (JSON, e.g. benchmarks/governor.py's "
        "governor_curve.json): the governor's stop is predicted on it and the token budget "
        "picked from it; needs --loss-value-device-hours-per-nat"))
    s.add_argument("--data-methods", default=DEFAULT_DATA_METHODS, metavar="M1,M2",
                   help=DATA_METHODS_HELP)
    s.add_argument("--precision", choices=("fp32", "bf16-mixed", "bf16"),
                   help="training precision (default: fp32 on cpu, bf16-mixed on accelerators)")
    s.add_argument("--optimizer-bits", metavar="B1,B2",
                   help="Adam-state widths to choose from, of 32,16,8,4 (default 32,8; 16,8 with "
                        "--precision bf16; 16 needs bf16, 32 needs fp32 parameters)")
    s.add_argument("--activation-bits", metavar="B1,B2", default="32",
                   help="saved-activation widths to choose from: 32 (as computed), 16, 8; "
                        "default 32 (each more width is one more capture and a larger solve)")
    s.set_defaults(fn=cmd_solve)

    r = sub.add_parser("run", help="run a saved plan for real and report prediction vs measurement")
    r.add_argument("plan", nargs="?", help="plan JSON from `trainplan solve --json` (with --resume "
                                           "default: the run directory's plan.json)")
    r.add_argument("--out", required=True, help="run directory")
    r.add_argument("--data", nargs="*", help=".txt/.jsonl files or folders (default: Shakespeare); "
                                              "with --resume the same as the first time")
    r.add_argument("--device", help="override the device, e.g. cpu")
    r.add_argument("--resume", action="store_true",
                   help="continue the interrupted run in --out from its latest checkpoint")
    r.add_argument("--overwrite", action="store_true",
                   help="replace a run already in --out (default: refuse)")
    r.add_argument("--checkpoint-every", type=int, metavar="N",
                   help="also checkpoint every N steps (default: at the end and on SIGINT/SIGTERM "
                        "only; 0: never)")
    r.set_defaults(fn=cmd_run)

    p = sub.add_parser("report", help="rebuild the HTML report of run directories; with several, "
                                      "also a report comparing them")
    p.add_argument("run_dirs", nargs="+")
    p.add_argument("--out", help="folder of the comparison report (default reports/compare-<time>); "
                                 "with one run directory, where its report is written instead")
    p.set_defaults(fn=cmd_report)

    d = sub.add_parser("demo", help="plan, run and report the tiny Llama on Shakespeare on this CPU")
    d.add_argument("--out", default="runs/demo")
    dg = d.add_mutually_exclusive_group()
    dg.add_argument("--budget-flops", type=float, default=DEMO_BUDGET_FLOPS,
                    help="compute budget, FLOPs (default 4e13: about 5 minutes on 2 cores)")
    dg.add_argument("--budget-seconds", type=float, help="wall-clock budget instead, s")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--loss-value-device-hours-per-nat", type=float, metavar="V",
                   help="turn the compute governor on (see `trainplan solve --help`)")
    d.add_argument("--data-methods", default=DEFAULT_DATA_METHODS, metavar="M1,M2",
                   help=DATA_METHODS_HELP)
    d.set_defaults(fn=cmd_demo)

    pr = sub.add_parser("profiles", help="list hardware profiles")
    pr.add_argument("--no-cpu", action="store_true", help="skip measuring the local CPU")
    pr.add_argument("--template", metavar="NAME", help="print profile NAME (or a profile file) as a TOML "
                                                       "file to edit for a device that ships no profile, "
                                                       "e.g. --template h100 > my-gpu.toml")
    pr.set_defaults(fn=cmd_profiles)

    c = sub.add_parser("calibrate", help="refit the local cpu profile, a GPU profile and the loss law "
                                         "from measured runs")
    c.add_argument("run_dirs", nargs="+")
    c.add_argument("--hw", help="the GPU profile to refit from runs on CUDA/ROCm: a name or a profile file "
                                "(default: the runs' plan's)")
    c.add_argument("--profile-out", metavar="FILE",
                   help="where to write the refit GPU profile, for --hw FILE (default: "
                        "RUN_DIR/<name>-calibrated.toml)")
    c.set_defaults(fn=cmd_calibrate)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except TrainplanError as e:
        print(f"trainplan: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("trainplan: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
