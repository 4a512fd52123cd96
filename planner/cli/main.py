"""`trainplan` command line: solve, run, report, demo, presets, profiles, calibrate, export, export-weights.

Thin by design: each command parses, calls the library, prints its product (the plan, a table,
the report's path) on stdout; progress and diagnostics go to stderr through `logging` (`-v`,
`-q`). A failure prints one line `trainplan: error: ...` and exits with the status `EXIT_CODES`
gives it: 2 for a usage error or bad input, 3 for an infeasible budget, 1 for a run that failed,
130 for an interrupt.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
import textwrap
import warnings
from collections.abc import Iterable

from trainplan.errors import InfeasibleError, TrainplanError
from trainplan.planner.cli.catalog import cmd_presets, cmd_profiles
from trainplan.planner.cli.commands import (
    DATA_METHODS_HELP,
    DEFAULT_DATA_METHODS,
    DEMO_BUDGET_FLOPS,
    RunStoppedEarly,
    cmd_calibrate,
    cmd_demo,
    cmd_report,
    cmd_run,
    cmd_solve,
)
from trainplan.planner.cli.export_cmd import cmd_export, export_flags
from trainplan.planner.cli.help_text import HelpFormatter, epilog
from trainplan.planner.cli.launching import add_launch_flags, is_other_rank
from trainplan.planner.cli.weights_cmd import cmd_export_weights

EXIT_CODES: dict[int, str] = {
    0: "success",
    1: "a run that failed: the loss diverged (NaN), out of memory, a worker process died or hung "
       "(the record so far is kept)",
    2: "usage error or bad input: an unknown flag, name or file, a value out of range",
    3: "infeasible: no plan fits the budget and memory (the line names what binds and the smallest "
       "change that fits)",
    130: "interrupted (Ctrl-C, SIGTERM): the run keeps its record and checkpoint; continue it with "
         "`trainplan run --out DIR --resume`",
}
"""Exit status -> what it means; the one table of them (docs/cli.md's is this one)."""

RUN_FAILURES = ("trainplan.errors:TrainingDivergedError", "trainplan.executor.checkpoint:OutOfMemoryRunError",
                "trainplan.executor.parallel.launch:WorkerFailedError")
"""`module:class` of the errors that mean a run failed (exit 1). Looked up in `sys.modules`: an
error of a class is raised only once its module is imported, and `trainplan` starts without
torch (the executor's modules import it)."""

LOGGERS = ("trainplan",)
"""trainplan's top-level logger (`logging.getLogger(__name__)` in every module falls under it):
`-v`/`-q` set their level; other libraries' loggers keep theirs."""


def exit_code(err: BaseException) -> int:
    """The exit status (`EXIT_CODES`) of a command that raised `err`: 130 an interrupt, 3 an
    infeasible budget, 1 a run that failed (`RUN_FAILURES`), 2 any other `TrainplanError`."""
    if isinstance(err, (KeyboardInterrupt, RunStoppedEarly)):
        return 130
    if isinstance(err, InfeasibleError):
        return 3
    for name in RUN_FAILURES:
        module, cls = name.split(":")
        failure = getattr(sys.modules.get(module), cls, None)
        if isinstance(failure, type) and isinstance(err, failure):
            return 1
    return 2


class _Stderr(logging.StreamHandler):
    """A handler on the `sys.stderr` of the moment (tests and `contextlib.redirect_stderr` swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


class _Format(logging.Formatter):
    """`trainplan: MESSAGE` for info, `trainplan: warning: MESSAGE` above it; with `-vv` each
    line names its level and logger."""

    def __init__(self, debug: bool):
        super().__init__()
        self.debug = debug

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if self.debug:
            return f"trainplan: {record.levelname.lower()}: {record.name}: {text}"
        return f"trainplan: {text}" if record.levelno <= logging.INFO else \
            f"trainplan: {record.levelname.lower()}: {text}"


IMPORT_NOISE = ("torchao", "torch.utils._pytree")
"""Other libraries' loggers that warn about themselves when imported, not about the user's input:
torchao names its C extensions built for other Pythons or GPUs, and torch's pytree warns about
torchao's enums (both when transformers imports accelerate, which imports torchao). Below `-vv`
they are set to ERROR, so that a command's bad input stays one line on stderr."""


def configure_logging(verbose: int = 0, quiet: bool = False, loggers: Iterable[str] = LOGGERS) -> int:
    """Set trainplan's loggers to WARNING, INFO (`verbose` 1), DEBUG (2 or more) or ERROR
    (`quiet`), each with one handler on stderr (called again, it replaces its own handler), and
    `IMPORT_NOISE` to ERROR below DEBUG. Returns the level."""
    level = logging.ERROR if quiet else (logging.WARNING, logging.INFO, logging.DEBUG)[min(verbose, 2)]
    for name in IMPORT_NOISE:
        logging.getLogger(name).setLevel(logging.ERROR if level > logging.DEBUG else logging.NOTSET)
    handler = _Stderr()
    handler.setFormatter(_Format(debug=level == logging.DEBUG))
    for name in loggers:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if isinstance(h, _Stderr)]:
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(level)
    return level


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (`trainplan: error: ...`, exit status 2, like every
    other bad input) that read negative numbers in any spelling (`--seq-len -5`,
    `--budget-seconds -1e3`, `-inf`) as values, so the checks behind them name the value."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(
            r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$", re.IGNORECASE)

    def error(self, message: str):
        sub = self.prog.split(" ", 1)[1] + ": " if " " in self.prog else ""
        if "expected one argument" in message:
            message += " (a value that starts with '-' is written OPTION=VALUE)"
        self.exit(2, f"trainplan: error: {sub}{message}; see `{self.prog} --help`\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trainplan")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _verbosity(p: argparse.ArgumentParser, top: bool) -> None:
    """-v/-q on the top-level parser and again on each command (`trainplan -v solve` and
    `trainplan solve -v` alike; a command's own count replaces the top-level one)."""
    default = 0 if top else argparse.SUPPRESS
    g = p.add_mutually_exclusive_group()
    g.add_argument("-v", "--verbose", action="count", default=default,
                   help="more on stderr: -v progress messages (INFO), -vv debug messages "
                        "(default: warnings and errors only)")
    g.add_argument("-q", "--quiet", action="store_true", default=False if top else argparse.SUPPRESS,
                   help="errors only: no warnings, no progress bar, no listing beside a file written")


def _sub(sub, name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, description=textwrap.fill(description or help, 90),
                       epilog=epilog(name), formatter_class=HelpFormatter)
    _verbosity(p, top=False)
    return p


def _tracker_flags(p: argparse.ArgumentParser) -> None:
    """`--tensorboard DIR`, `--wandb-project NAME`, `--trackio-project NAME` of the commands that
    train (`trainplan.executor.reporting.trackers.TrackerSpec.from_args` reads them)."""
    g = p.add_argument_group("trackers", "report the run's scalars while it trains, from rank 0: loss, "
                                         "held-out loss, step time, memory, tokens, predicted beside measured")
    g.add_argument("--tensorboard", metavar="DIR",
                   help="write TensorBoard event files to DIR (extra: pip install 'trainplan[tensorboard]')")
    g.add_argument("--wandb-project", metavar="NAME",
                   help="log to this wandb project (extra: pip install 'trainplan[wandb]')")
    g.add_argument("--trackio-project", metavar="NAME",
                   help="log to this trackio project (extra: pip install 'trainplan[trackio]')")


def build_parser() -> argparse.ArgumentParser:
    codes = "\n".join(textwrap.fill(what, 92, initial_indent=f"  {c:>3}  ", subsequent_indent=" " * 7)
                      for c, what in EXIT_CODES.items())
    ap = _Parser(prog="trainplan", description=__doc__.splitlines()[0],
                 epilog="start with `trainplan demo`, or plan: `trainplan solve --help`\n\nexit status:\n" + codes)
    ap.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    _verbosity(ap, top=True)
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = _sub(sub, "solve", "plan a training run and print it",
             "Plan a training run: every knob (parallelism, ZeRO stage, micro-batch, checkpointing, "
             "precision, bits, data subset, token budget) chosen jointly by one CP-SAT model.")
    s.add_argument("--model", required=True, help="model preset, e.g. llama3-70b, tiny-llama (`trainplan presets` "
                                                   "lists them), or a transformers config.json or a folder holding one")
    s.add_argument("--hw", required=True, help="hardware profile, e.g. mi300, h100, cpu, or a profile file "
                                                "./my-gpu.toml (`trainplan profiles` lists them; "
                                                "`trainplan profiles --template h100` writes a file)")
    s.add_argument("--devices", type=int, default=1, metavar="N",
                   help="number of devices (GPUs, or CPU processes) the run uses")
    s.add_argument("--seq-len", type=int, default=2048, metavar="TOKENS", help="tokens per sequence")
    s.add_argument("--max-seq-len", action="store_true",
                   help="plan the longest sequence the budget fits instead of --seq-len (a multiple of "
                        "1024 tokens up to 64M; tiled loss, tiled MLP and activation offload join the "
                        "search where nothing fits without them)")
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--budget-device-hours", type=float, metavar="H",
                   help="compute budget in device-hours (devices x wall-clock hours)")
    g.add_argument("--budget-seconds", type=float, metavar="S", help="wall-clock budget, seconds")
    g.add_argument("--budget-flops", type=float, metavar="FLOPS",
                   help="compute budget in FLOPs, all devices together (e.g. 1e21)")
    s.add_argument("--data-tokens", type=int, metavar="TOKENS",
                   help="unique tokens in the corpus (default: --data's, else unconstrained)")
    s.add_argument("--data", nargs="*", metavar="PATH", help="the corpus the plan trains on (as `run --data`; "
                   "`--data` alone: Shakespeare): with --hw cpu, pilots on it fit the loss law if at most 10%% of "
                   "the budget; without --data no pilots run and the published law predicts")
    s.add_argument("--global-batch-tokens", type=int, metavar="TOKENS",
                   help="tokens per optimizer step, all devices together (e.g. 4194304): every plan "
                        "trains exactly that (dp_degree x micro_batch x seq_len x grad_accum), the solver "
                        "setting gradient accumulation with the micro-batch (default: grad_accum 1)")
    s.add_argument("--json", metavar="FILE",
                   help="write the plan JSON to FILE; `-`: to stdout, the readable plan then to stderr")
    s.add_argument("--time-limit", type=float, default=10.0, metavar="S",
                   help="solver time limit in CP-SAT deterministic seconds (reproducible: same inputs and "
                        "seed, same plan)")
    s.add_argument("--memory-limit-gib", type=float, metavar="GIB", help="per-device cap for tensors, below the "
                   "profile's usable memory (default: that; e.g. 70 on an 80 GiB GPU to leave headroom)")
    s.add_argument("--seed", type=int, default=0,
                   help="the solver's seed and the run's (weights, data order)")
    s.add_argument("--frontier", action="store_true",
                   help="also solve a ladder of budgets and memory caps and print the Pareto "
                        "frontier (memory, device-hours, predicted loss); writes frontier.csv "
                        "and frontier.png")
    s.add_argument("--frontier-out", metavar="DIR",
                   help="folder for frontier.csv/.png (default: beside --json, else ./frontier)")
    s.add_argument("--loss-value-device-hours-per-nat", type=float, metavar="V", help=(
        "turn the compute governor on: one nat less held-out loss is worth V device-hours; "
        "it stops the run once a step's predicted loss drop is worth less than its cost "
        "(default: off)"))
    s.add_argument("--heldout-curve", metavar="FILE", help=(
        "a held-out curve calibrated on pilot runs (JSON, e.g. benchmarks/governor.py's "
        "governor_curve.json): the governor's stop is predicted on it and the token budget "
        "picked from it; needs --loss-value-device-hours-per-nat"))
    s.add_argument("--data-methods", default=DEFAULT_DATA_METHODS, metavar="M1,M2",
                   help=DATA_METHODS_HELP)
    s.add_argument("--precision", choices=("fp32", "bf16-mixed", "bf16"),
                   help="training precision (default: fp32 on cpu, bf16-mixed on accelerators)")
    s.add_argument("--optimizer-bits", metavar="B1,B2",
                   help="Adam-state widths to choose from, bits, of 32,16,8,4 (default 32,8; 16,8 with "
                        "--precision bf16; 16 needs bf16, 32 needs fp32 parameters)")
    s.add_argument("--activation-bits", metavar="B1,B2", default="32",
                   help="saved-activation widths to choose from, bits: 32 (as computed), 16, 8 "
                        "(each more width is one more capture and a larger solve)")
    _schedule_flags(s, solved=True)
    s.set_defaults(fn=cmd_solve)

    r = _sub(sub, "run", "run a saved plan for real and report prediction vs measurement")
    r.add_argument("plan", nargs="?", metavar="PLAN",
                   help="plan JSON from `trainplan solve --json` (with --resume default: the run "
                        "directory's plan.json)")
    r.add_argument("--out", required=True, metavar="DIR", help="run directory (created if missing)")
    r.add_argument("--data", nargs="*", metavar="PATH",
                   help="text: .txt/.jsonl, .json/.parquet/.arrow (HF datasets, streamed) files or folders; "
                        "or one pre-tokenized .bin/.npy file (default: Shakespeare); with --resume the "
                        "same as the first time")
    r.add_argument("--tokenizer", metavar="FILE",
                   help="the model's tokenizer.json (HF tokenizers) for text --data; its vocabulary must "
                        "be the plan's (default: a BPE trained on the corpus)")
    r.add_argument("--token-dtype", choices=("uint16", "uint32"), default=None,
                   help="the ids' dtype in a raw .bin token file (default: uint16, as nanoGPT's train.bin)")
    r.add_argument("--text-column", default="text", metavar="NAME",
                   help="the text field of .jsonl/.json/.parquet/.arrow rows (default: text)")
    r.add_argument("--device", help="override the plan's device, e.g. cpu, cuda:0 (default: the plan's)")
    r.add_argument("--resume", action="store_true",
                   help="continue the interrupted run in --out from its latest checkpoint (a run folder is input: its "
                        "pickles load as data only, a crafted one is refused; resume only folders you trust)")
    r.add_argument("--overwrite", action="store_true",
                   help="replace a run already in --out (default: refuse)")
    r.add_argument("--checkpoint-every", type=int, metavar="STEPS",
                   help="also checkpoint every this many optimizer steps (default: at the end and on "
                        "SIGINT/SIGTERM only; 0: never)")
    _schedule_flags(r, solved=False)
    _tracker_flags(r)
    add_launch_flags(r)
    r.set_defaults(fn=cmd_run)

    p = _sub(sub, "report", "rebuild the HTML report of run directories; with several, also a report "
                            "comparing them")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (the --out of "
                                                                  "`trainplan run` or `trainplan demo`)")
    p.add_argument("--out", metavar="DIR",
                   help="folder of the comparison report (default: reports/compare-<time>); "
                        "with one run directory, where its report is written instead")
    p.set_defaults(fn=cmd_report)

    d = _sub(sub, "demo", "plan, run and report the tiny Llama on Shakespeare on this CPU")
    d.add_argument("--out", default="runs/demo", metavar="DIR", help="run directory (replaced)")
    dg = d.add_mutually_exclusive_group()
    dg.add_argument("--budget-flops", type=float, default=DEMO_BUDGET_FLOPS, metavar="FLOPS",
                    help="compute budget, FLOPs (default: %(default).0e, about 5 minutes on 2 cores)")
    dg.add_argument("--budget-seconds", type=float, metavar="S", help="wall-clock budget instead, seconds")
    d.add_argument("--seed", type=int, default=0, help="the solver's seed and the run's (weights, data order)")
    d.add_argument("--loss-value-device-hours-per-nat", type=float, metavar="V",
                   help="turn the compute governor on (see `trainplan solve --help`; default: off)")
    d.add_argument("--data-methods", default=DEFAULT_DATA_METHODS, metavar="M1,M2",
                   help=DATA_METHODS_HELP)
    _schedule_flags(d, solved=False)
    _tracker_flags(d)
    d.set_defaults(fn=cmd_demo)

    m = _sub(sub, "presets", "list the model presets --model accepts")
    m.set_defaults(fn=cmd_presets)

    pr = _sub(sub, "profiles", "list hardware profiles")
    pr.add_argument("--measure-cpu", action="store_true",
                    help="also list this machine's cpu profile, measured (about 4 s) if this host has "
                         "none cached (default: the accelerators only)")
    pr.add_argument("--no-cpu", action="store_true", help=argparse.SUPPRESS)  # the default now; kept for scripts
    pr.add_argument("--template", metavar="NAME", help="print profile NAME (or a profile file) as a TOML "
                                                       "file to edit for a device that ships no profile, "
                                                       "e.g. --template h100 > my-gpu.toml")
    pr.set_defaults(fn=cmd_profiles)

    c = _sub(sub, "calibrate", "refit the local cpu profile, a GPU profile and the loss law from measured runs")
    c.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="finished run directories (the --out "
                                                                  "of `trainplan run`)")
    c.add_argument("--hw", help="the GPU profile to refit from runs on CUDA/ROCm: a name or a profile file "
                                "(default: the runs' plan's)")
    c.add_argument("--profile-out", metavar="FILE",
                   help="where to write the refit GPU profile, for --hw FILE (default: "
                        "RUN_DIR/<name>-calibrated.toml)")
    c.set_defaults(fn=cmd_calibrate)

    x = _sub(sub, "export", "write a plan as torchtitan's job TOML, DeepSpeed's config JSON or accelerate's "
                            "config YAML, listing what the framework cannot express")
    export_flags(x)
    x.set_defaults(fn=cmd_export)

    w = _sub(sub, "export-weights", "write a run's trained weights as a Hugging Face model folder (safetensors) "
                                    "with its tokenizer, for transformers' from_pretrained")
    w.add_argument("run_dir", metavar="RUN_DIR", help="run directory with a checkpoint (the --out of "
                                                      "`trainplan run`; an interrupted run's too)")
    w.add_argument("--out", required=True, metavar="DIR",
                   help="new or empty folder for config.json, model.safetensors and the tokenizer")
    w.add_argument("--dtype", choices=("bf16", "fp32"),
                   help="dtype of the weights written (default: the dtype the run trained its parameters in)")
    w.set_defaults(fn=cmd_export_weights)
    ap.description = f"`trainplan` command line: {', '.join(sub.choices)}."  # every command, from the parser
    return ap


def _schedule_flags(p: argparse.ArgumentParser, *, solved: bool) -> None:
    """--lr and --warmup-steps: the learning-rate schedule's peak and warmup, set in the plan
    (`solved`: by `solve`) or overriding the plan's (by `run` and `demo`)."""
    whose = "" if solved else "the plan's, "
    p.add_argument("--lr", type=float, metavar="LR",
                   help=f"peak learning rate of AdamW's warmup-stable-decay schedule (default: {whose}DeepSeek "
                        "LLM's law at the plan's compute from 1e17 FLOPs up, else 3e-3; a rate over 3x from the "
                        "law is warned about)")
    p.add_argument("--warmup-steps", type=int, metavar="STEPS",
                   help=f"optimizer steps of linear warmup (default: {whose}a tenth of the plan's steps, "
                        "1 to 20; from 1e17 FLOPs up, to DeepSeek LLM's 2000)")


def main(argv: list[str] | None = None) -> int:
    """Run the `trainplan` command line on `argv` (default: sys.argv[1:]); returns the exit status
    (`EXIT_CODES`). argparse's usage errors exit 2 (SystemExit), `--help`/`--version` 0; a
    stdout whose reader closed early (`trainplan report RUN | head -1`) 0, without a traceback."""
    args = build_parser().parse_args(argv)
    quiet = args.quiet = bool(getattr(args, "quiet", False)) or is_other_rank()  # rank 0 speaks
    configure_logging(getattr(args, "verbose", 0) or 0, quiet)
    logging.getLogger(__name__).debug("arguments: %s", vars(args))
    try:
        with warnings.catch_warnings() if quiet else contextlib.nullcontext():
            if quiet:  # errors only: Python warnings too
                warnings.simplefilter("ignore")
            code = args.fn(args)
            sys.stdout.flush()  # a reader gone (`| head -1`) shows here, not at the interpreter's exit
            return code
    except BrokenPipeError:  # Python docs, "Note on SIGPIPE": the rest of stdout to devnull, quietly
        with contextlib.suppress(OSError, ValueError):  # a stdout without a file descriptor (tests)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except RunStoppedEarly as e:  # interrupted: the line says how to continue
        print(f"trainplan: {e}", file=sys.stderr)
        return exit_code(e)
    except TrainplanError as e:
        print(f"trainplan: error: {e}", file=sys.stderr)
        return exit_code(e)
    except KeyboardInterrupt as e:
        print("trainplan: interrupted", file=sys.stderr)
        return exit_code(e)


if __name__ == "__main__":
    sys.exit(main())
