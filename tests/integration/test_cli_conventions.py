"""The command line's conventions (`trainplan.planner.cli.main`): `--version`, help with defaults and worked
examples, `trainplan presets`, `--json -`, `--lr`/`--warmup-steps`, the exit codes, `-v`/`-q`.

In-process (`main(argv)`), with training stubbed where a command would train: the run's own
behaviour is tested in tests/unit/executor and tests/integration/test_faults.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import subprocess
import sys
import types
from importlib.metadata import version
from pathlib import Path

import pytest

from trainplan.errors import InfeasibleError, TrainingDivergedError, TrainplanError
from trainplan.planner.cli.help_text import EXAMPLES
from trainplan.planner.cli.main import EXIT_CODES, build_parser, configure_logging, exit_code, main
from trainplan.planner.plan import Plan

ROOT = Path(__file__).resolve().parents[2]
TINY = ["solve", "--model", "tiny-llama", "--hw", "cpu", "--seq-len", "128", "--budget-seconds", "60"]


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """Two solved tiny-llama plans on cpu: one device and two (torchrun's path)."""
    folder = tmp_path_factory.mktemp("plans")
    for n in (1, 2):
        assert main(TINY + ["--devices", str(n), "--json", str(folder / f"plan{n}.json")]) == 0
    return folder


# ---------------------------------------------------------------- --version, help, examples


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"trainplan {version('trainplan')}"


def test_every_flag_has_help_and_shows_its_default():
    for name, parser in {"trainplan": build_parser(), **_commands()}.items():
        for action in parser._actions:
            skip = isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
            if skip or action.help == argparse.SUPPRESS:
                continue
            assert action.help, f"{name} {action.option_strings or action.dest}: no help"
            shown = parser._get_formatter()._get_help_string(action) or ""
            unset = action.default is None or action.default is False or action.default is argparse.SUPPRESS
            if action.option_strings and not unset:
                assert "default" in shown, f"{name} {action.option_strings}: default {action.default!r} not shown"
    solve = _commands()["solve"].format_help()
    for needle in ("--seq-len TOKENS", "tokens per sequence (default: 2048)", "--devices N",
                   "--budget-device-hours H", "device-hours", "--seed SEED", "(default: 0)", "examples:"):
        assert needle in solve, needle


def test_every_command_has_worked_examples_that_parse():
    """Each example parses with the real parser (shell redirection left off) and names flags
    that exist; every command has at least two, but `presets`, which has no flags."""
    commands = _commands()
    assert set(EXAMPLES) == set(commands), set(EXAMPLES) ^ set(commands)
    for name, examples in EXAMPLES.items():
        assert len(examples) >= (1 if name == "presets" else 2), name
        assert "examples:" in commands[name].format_help()
        for _, line in examples:
            words = shlex.split(line)
            assert words[:2] == ["trainplan", name], line
            words = words[1:words.index(">")] if ">" in words else words[1:]
            args = build_parser().parse_args(words)
            assert args.command == name and callable(args.fn), line


def test_presets_lists_every_preset(capsys):
    from trainplan.modeling.presets import known_presets

    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:3] == ["name", "family", "params_b"], lines[0]
    rows = {ln.split()[0]: ln.split() for ln in lines[1:]}
    assert list(rows) == known_presets()
    assert rows["llama3-70b"][2:4] == ["70.55", "80"], rows["llama3-70b"]  # 1e9 parameters, layers


def test_profiles_measure_cpu_adds_the_cpu_row(capsys, monkeypatch):
    import dataclasses

    import trainplan.hardware_profiles

    fake = dataclasses.replace(trainplan.hardware_profiles.load("h100"), name="cpu", aliases=())
    monkeypatch.setattr(trainplan.hardware_profiles, "load_cpu", lambda **k: fake)
    assert main(["profiles", "--measure-cpu"]) == 0
    names = [ln.split()[0] for ln in capsys.readouterr().out.strip().splitlines()[1:]]
    assert "cpu" in names and "h100" in names, names


# ---------------------------------------------------------------- --json -, --lr, --warmup-steps


def test_json_dash_writes_the_plan_alone_on_stdout(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(TINY + ["--json", "-", "--lr", "1e-3", "--warmup-steps", "5"]) == 0
    out, err = capsys.readouterr()
    plan = Plan.from_json(out)  # stdout is the plan's JSON and nothing else
    assert json.loads(out)["model"] == "tiny-llama"
    assert (plan.decisions.lr, plan.decisions.warmup_steps) == (1e-3, 5)
    assert any("lr=0.001 set by --lr (solved: 0.003)" in n for n in plan.notes), plan.notes
    assert "plan: tiny-llama" in err and "solver:" in err, err
    assert list(tmp_path.iterdir()) == [], "a file named '-' was written"


@pytest.fixture
def fake_run(monkeypatch):
    """`trainplan run` up to the training: the corpus and the run stubbed. `seen` gets the data
    paths and the plan the run was given; `outcome(plan)` is what the run does."""
    import trainplan.executor.train
    import trainplan.executor.worker
    import trainplan.planner.cli.commands as commands

    seen: dict = {}

    def corpus_for(plan, data_paths, progress, options=None):
        seen["data"] = data_paths

    def run(plan, **kwargs):
        seen["plan"] = plan
        return seen["outcome"](plan)

    def launch(plan_path, out, data, device, **kwargs):
        seen["plan"] = Plan.from_json(plan_path)  # what the workers read
        return seen["outcome"](seen["plan"])

    def interrupt(plan):
        raise KeyboardInterrupt

    seen["outcome"] = interrupt
    monkeypatch.setattr(commands, "_corpus_for", corpus_for)
    monkeypatch.setattr(commands, "_check_data", lambda data_paths, options=None: None)
    monkeypatch.setattr(trainplan.executor.train, "run", run)
    monkeypatch.setattr(trainplan.executor.worker, "launch", launch)
    return seen


@pytest.mark.parametrize("devices", [1, 2])
def test_run_lr_and_warmup_reach_the_run(plans, fake_run, tmp_path, capsys, devices):
    """--lr/--warmup-steps replace the plan's in the plan the run (or, above one device, every
    torchrun worker) gets; a PLAN after `--data` paths is the plan, not a corpus file."""
    argv = ["run", "--data", "a.txt", "b/", str(plans / f"plan{devices}.json"), "--out", str(tmp_path / "run"),
            "--lr", "2e-3", "--warmup-steps", "3"]
    assert main(argv) == 130  # the stub's Ctrl-C
    assert capsys.readouterr().err.strip().splitlines()[-1] == "trainplan: interrupted"
    d = fake_run["plan"].decisions
    assert (d.lr, d.warmup_steps, d.devices) == (2e-3, 3, devices)
    assert fake_run["data"] == ["a.txt", "b/"]


@pytest.mark.parametrize("flags, needle", [
    (["--lr", "0"], "--lr 0.0: give the peak learning rate, a finite number in (0, 10]"),
    (["--lr", "inf"], "--lr inf"),
    (["--warmup-steps", "-1"], "--warmup-steps -1: give a whole number of optimizer steps >= 0"),
    (["--warmup-steps", "100000"], "--warmup-steps 100000: the plan has"),
])
def test_run_rejects_a_bad_schedule(plans, fake_run, tmp_path, capsys, flags, needle):
    assert main(["run", str(plans / "plan1.json"), "--out", str(tmp_path / "run"), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainplan: error: ") and needle in err[0], err
    assert "plan" not in fake_run, "the run started"


# ---------------------------------------------------------------- exit codes


def test_exit_codes_of_errors():
    from trainplan.executor.checkpoint import OutOfMemoryRunError
    from trainplan.executor.parallel.launch import WorkerFailedError
    from trainplan.planner.cli.commands import RunStoppedEarly

    assert set(EXIT_CODES) == {0, 1, 2, 3, 130}
    cases = {TrainplanError("bad"): 2, InfeasibleError("memory binds"): 3, TrainingDivergedError("nan"): 1,
             OutOfMemoryRunError("oom"): 1, WorkerFailedError("rank 1 died", rank=1, exit_code=-9): 1,
             KeyboardInterrupt(): 130, RunStoppedEarly("interrupted after 3 of 9 steps"): 130}
    for err, code in cases.items():
        assert exit_code(err) == code, (err, code)


@pytest.mark.parametrize("outcome, code, line", [
    ("oom", 1, "trainplan: error: out of memory in step 3"),
    ("interrupted", 130, "trainplan: interrupted after 3 of "),
])
def test_run_exit_codes_through_main(plans, fake_run, tmp_path, capsys, outcome, code, line):
    from trainplan.executor.checkpoint import OutOfMemoryRunError

    def oom(plan):
        raise OutOfMemoryRunError("out of memory in step 3 on cpu")

    def interrupted(plan):
        return types.SimpleNamespace(stop_reason="interrupted", steps=3, checkpoint="")

    fake_run["outcome"] = {"oom": oom, "interrupted": interrupted}[outcome]
    assert main(["run", str(plans / "plan1.json"), "--out", str(tmp_path / "run")]) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(line), err


def test_the_console_script_exits_with_the_codes():
    """The installed `trainplan` script: --version (0) and a usage error (2), neither loading torch."""
    script = Path(sys.executable).parent / "trainplan"
    done = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("trainplan "), done
    done = subprocess.run([str(script), "solve", "--model", "tiny-llama"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and done.stderr.startswith("trainplan: error: solve: the following"), done


def test_run_checks_data_paths_before_loading_torch(tmp_path):
    """`trainplan run` names a missing or unsupported --data path, or a token file given with
    --tokenizer, at once: before the plan's model (and torch) is built."""
    (tmp_path / "t.bin").write_bytes(b"\0" * 64)
    (tmp_path / "notes.csv").write_text("a,b\n")
    code = ("import sys; from trainplan.planner.cli.main import main\n"
            "for data in (['missing.txt'], ['notes.csv'], ['t.bin', '--tokenizer', 'tok.json']):\n"
            "    assert main(['run', 'p.json', '--out', 'o', '--data', *data]) == 2\n"
            "assert 'torch' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    lines = done.stderr.splitlines()
    assert done.returncode == 0 and len(lines) == 3, done
    assert lines[0].startswith("trainplan: error: corpus path missing.txt does not exist"), lines
    assert "unsupported extension '.csv'" in lines[1] and "leave --tokenizer out" in lines[2], lines


def test_a_reader_that_closes_stdout_early_ends_the_command_quietly():
    """`trainplan profiles | head -0`: stdout's reader gone before the table is written (the read end
    closed at once): exit 0 and nothing on stderr, not a BrokenPipeError traceback (any command:
    `main` handles it)."""
    script = Path(sys.executable).parent / "trainplan"
    proc = subprocess.Popen([str(script), "profiles"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    proc.stdout.close()  # before the command writes: its first flush meets EPIPE
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (0, ""), err


def test_the_cli_docs_page_documents_the_exit_codes_and_the_help():
    page = (ROOT / "docs" / "cli.md").read_text()
    for code in EXIT_CODES:
        assert f"| {code} |" in page, f"exit status {code} missing from docs/cli.md's table"
    assert "usage: trainplan [-h] [--version] [-v | -q] COMMAND ..." in page
    assert "usage: trainplan solve" in page


def test_the_help_and_its_docs_list_every_command(monkeypatch, capsys):
    """Issue #40, item 14: `trainplan --help` once listed 7 commands in its first line, leaving
    out export and export-weights. The line comes from the parser; docs/cli.md's copy of the help
    (at 100 columns) is the help."""
    import argparse

    monkeypatch.setenv("COLUMNS", "100")
    ap = build_parser()
    commands = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"export", "export-weights"} <= set(commands), commands
    text = ap.format_help()
    assert f"`trainplan` command line: {', '.join(commands)}." in text
    for name in commands:
        assert f"\n    {name} " in text or f"\n    {name}\n" in text, f"{name} missing from the help's list"
    page = (ROOT / "docs" / "cli.md").read_text()
    assert "$ trainplan --help\n" + text in page, "docs/cli.md's `trainplan --help` block is not the help"


# ---------------------------------------------------------------- -v / -q


@pytest.mark.parametrize("argv, verbose, quiet", [
    (["profiles"], 0, False), (["-v", "profiles"], 1, False), (["profiles", "-vv"], 2, False),
    (["-q", "profiles"], 0, True), (["profiles", "-q"], 0, True),
])
def test_verbosity_flags_parse_before_or_after_the_command(argv, verbose, quiet):
    args = build_parser().parse_args(argv)
    assert (args.verbose, args.quiet) == (verbose, quiet)


def test_log_levels(capsys):
    log = logging.getLogger("trainplan.planner.cli.test")
    try:
        for (verbose, quiet), shown in {(0, False): "W", (1, False): "IW", (2, False): "DIW", (0, True): ""}.items():
            configure_logging(verbose, quiet)
            log.debug("D")
            log.info("I")
            log.warning("W")
            err = capsys.readouterr().err
            lines = [ln.rsplit(": ", 1)[-1] for ln in err.splitlines()]
            assert "".join(lines) == shown, (verbose, quiet, err)
            assert all(ln.startswith("trainplan: ") for ln in err.splitlines()), err
    finally:
        configure_logging()


def test_verbose_profiles_says_why_cpu_is_missing(capsys):
    try:
        assert main(["-v", "profiles"]) == 0
        assert "trainplan: cpu (this machine, measured) not listed: add --measure-cpu" in capsys.readouterr().err
        assert main(["profiles"]) == 0
        assert capsys.readouterr().err == ""
    finally:
        configure_logging()
