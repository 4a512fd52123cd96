"""The bad-input table (docs/bad_inputs.md): one test per row, the test id is the row's id.

Each CLI row runs `trainplan.planner.cli.main.main(argv)` in a scratch folder (so the paths in messages are the
table's) and checks: exit status 2, exactly one stderr line starting `trainplan: error:`, no
traceback, the bad value and the valid alternatives in that line, and the error's type (a
run that failed exits 1, an infeasible budget 3: `trainplan.planner.cli.main.EXIT_CODES`). API rows
call the library and check the typed error and its message. Fast: no row solves a large model,
and the one training run (a NaN loss) is 2 steps of tiny-llama.
"""

from __future__ import annotations

import json
import random
import shlex
import types
from pathlib import Path

import pytest
import torch
from torch import nn

import trainplan.planner.cli.main as cli
from trainplan.costmodels.stopping.heldout_curve import HeldoutCurve
from trainplan.errors import (
    BudgetError,
    CaptureError,
    DataError,
    DeviceError,
    ExportMemoryError,
    InfeasibleError,
    ModelConfigError,
    OutputPathError,
    PlanMismatchError,
    TrainingDivergedError,
    TrainplanError,
    UnknownNameError,
    UnsafeFileError,
)
from trainplan.executor.record import RunRecord
from trainplan.planner.api import plan_for_choice, solve
from trainplan.planner.budget import Budget

CUDA = torch.cuda.is_available()
WORDS = ["to", "be", "or", "not", "to", "be", "that", "is", "the", "question", "whether", "tis", "nobler",
         "in", "the", "mind", "to", "suffer"]
TINY = "solve --model tiny-llama --hw cpu --seq-len 128"


def _words(lines: int, seed: int) -> str:
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(15)) for _ in range(lines)) + "\n"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, cpu_profile) -> Path:
    """A scratch folder with the plans, corpora and run folders the rows name."""
    from trainplan.executor.data.batches import load_corpus

    d = tmp_path_factory.mktemp("bad_inputs")
    plan = plan_for_choice("tiny-llama", cpu_profile, seq_len=128, micro_batch=1, max_steps=2)
    plan.to_json(d / "plan.json")
    raw = json.loads(plan.to_json())
    for name, edit in {"plan_params.json": {"model_n_params": 123},
                       "plan_8b.json": {"model": "llama3-8b"},
                       "plan_user.json": {"model": "MyNet"},
                       "plan_h100.json": {"hw": "h100"},
                       "plan_bad_field.json": {"decisions": raw["decisions"] | {"seq_len": "abc"}},
                       "plan_bad_sp.json": {"decisions": raw["decisions"] | {"sp_degree": 3}},
                       "plan_bits_float.json": {"decisions": raw["decisions"] | {"activation_bits": 8.0}},
                       "plan_gov_str.json": {"decisions": raw["decisions"] | {"governor_threshold": "x"}},
                       "plan_warmup.json": {"decisions": raw["decisions"] | {"warmup_steps": 1000}},
                       "plan_mb_edited.json": {"decisions": raw["decisions"] | {"micro_batch": 100000}},
                       "plan_ckpt_edited.json": {"decisions": raw["decisions"] | {
                           "activation_checkpoint": ["full"] * len(raw["decisions"]["activation_checkpoint"])}},
                       "plan_step_time.json": {"predictions": raw["predictions"] | {"step_time_s": -1}},
                       "plan_format_2.json": {"format": 2}, "plan_format_true.json": {"format": True},
                       "plan_format_float.json": {"format": 1.0},
                       "plan_seed_huge.json": {"decisions": raw["decisions"] | {"seed": 2**70}},
                       "plan_lr_true.json": {"decisions": raw["decisions"] | {"lr": True}},
                       "plan_sets_str.json": {"decisions": raw["decisions"] | {"checkpoint_sets": "x"}},
                       "plan_budget_str.json": {"budget": "x"}}.items():
        (d / name).write_text(json.dumps(raw | edit))
    tight = plan_for_choice("llama3.1-8b", "h100", seq_len=4096, micro_batch=8, devices=2, zero_stage=3,
                            precision="bf16-mixed", optimizer_bits=8, activation_checkpoint="full")
    tight.to_json(d / "plan_tight.json")  # fits with 8-bit Adam, not with fp32 AdamW (the export rows)
    (d / "plan_tight_70b.json").write_text(json.dumps(json.loads(tight.to_json()) | {"model": "llama3-70b"}))
    raw_tight = json.loads(tight.to_json())  # as `solve --hw h100-cal.toml` writes it: the file recorded
    (d / "plan_tight_cal.json").write_text(json.dumps(raw_tight | {"hw": "h100-cal", "options": (
        raw_tight.get("options") or {}) | {"hw_profile_file": "h100-cal.toml"}}))
    (d / "garbage.json").write_bytes(b"\xff\xfe\x00\x81 not a plan")
    from trainplan.hardware_profiles import load
    from trainplan.hardware_profiles.profile_file import profile_toml

    (d / "bad_profile.toml").write_text("\n".join("memory_efficiency = 1.5" if line.startswith("memory_efficiency =")
                                                  else line for line in profile_toml(load("h100")).splitlines()))
    (d / "curve_neg.json").write_text(json.dumps(HeldoutCurve(
        E=2.5, B=2.9, beta=0.17, gamma=-0.03, kappa=1.3, zeta=0.5, d_ref_tokens=1e5, u_ref_tokens=4e4,
        tokens_per_step=1024.0, unique_tokens=4e4).to_dict()))
    (d / "curve_gain.json").write_text(json.dumps(HeldoutCurve(
        E=2.5, B=2.9, beta=0.17, gamma=0.03, kappa=1.3, zeta=0.5, d_ref_tokens=1e5, u_ref_tokens=4e4,
        tokens_per_step=1024.0, unique_tokens=4e4, cooldown_gain_nats=1e9).to_dict()))
    (d / "curve_8b.json").write_text(json.dumps(HeldoutCurve(
        E=2.5, B=2.9, beta=0.17, gamma=0.03, kappa=1.3, zeta=0.5, d_ref_tokens=1e5, u_ref_tokens=4e4,
        tokens_per_step=1024.0, unique_tokens=4e4, model="llama3-8b", vocab_size=128256).to_dict()))
    for name, cfg in {"model_no_type.json": {"hidden_size": 64}, "model_t5.json": {"model_type": "t5"},
                      "model_bert.json": {"model_type": "bert", "hidden_size": 64},
                      "model_unknown.json": {"model_type": "qwen", "hidden_size": 64}}.items():
        (d / name).write_text(json.dumps(cfg))  # the model-config rows (126-131)
    _issue40_input_files(d, raw)
    (d / "small.txt").write_text("hello world\n")
    (d / "mid.txt").write_text(_words(300, 0))
    (d / "bad.txt").write_bytes(b"\xff\xfe bad bytes")
    (d / "empty.txt").write_text("")
    (d / "notes.csv").write_text("a,b\n1,2\n")
    _data_format_files(d)
    (d / "old_run").mkdir()
    (d / "old_run" / "record.json").write_text("{}")
    # a corpus and a plan for it whose learning rate makes the loss NaN at the second step
    (d / "words.txt").write_text(_words(600, 2))
    corpus = load_corpus([d / "words.txt"], vocab_size=512)
    nan_plan = plan_for_choice("tiny-llama", cpu_profile, seq_len=64, micro_batch=2, max_steps=8,
                               vocab_size=corpus.vocab_size, lr=10.0)  # LR_MAX: NaN at step 3
    nan_plan.to_json(d / "nan_plan.json")
    # a finished cpu run of 2 timed steps: too short to calibrate the cpu profile
    (d / "short_run").mkdir()
    plan.to_json(d / "short_run" / "plan.json")
    RunRecord(model="tiny-llama", hw_planned="cpu", device="cpu", same_hardware=True, steps=2,
              tokens=256, step_times_s=[0.5, 0.4], stop_reason="budget",
              heldout_loss=[(1, 128, 9.0), (2, 256, 8.9)]).to_json(d / "short_run" / "record.json")
    _issue40_crafted_run(d, cpu_profile)
    import shutil

    shutil.copytree(d / "short_run", d / "edited_run")  # a finished run whose plan.json was edited to lr 1e6
    shutil.copyfile(d / "plan_lr_huge.json", d / "edited_run" / "plan.json")
    return d


def _issue40_input_files(d: Path, raw: dict) -> None:
    """The files of issue #40's input rows (items 5, 6, 17): an incomplete model config, edited plans."""
    (d / "model_sizes.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 4}))
    (d / "plan_lr_huge.json").write_text(json.dumps(raw | {"decisions": raw["decisions"] | {"lr": 1e6}}))
    (d / "plan_h800.json").write_text(json.dumps(raw | {"hw": "h800"}))
    (d / "plan_mem_huge.json").write_text(json.dumps(raw | {"hw": "h100", "predictions": raw["predictions"] | {
        "memory_bytes": raw["predictions"]["memory_bytes"] | {"total": 1e15}}}))


def _issue40_crafted_run(d: Path, cpu_profile) -> None:
    """`crafted_run/`: a real 2-step run of `crafted_plan.json` on words.txt, its record removed (as if
    interrupted), whose checkpoint's rank0.pt is a pickle that would call os.makedirs('pwned')."""
    import os
    import shutil

    from trainplan.executor.data.batches import load_corpus

    corpus = load_corpus([d / "words.txt"], vocab_size=512)
    plan_for_choice("tiny-llama", cpu_profile, seq_len=64, micro_batch=2, max_steps=2,
                    vocab_size=corpus.vocab_size).to_json(d / "crafted_plan.json")
    assert cli.main(["run", str(d / "crafted_plan.json"), "--out", str(d / "crafted_run"), "--data",
                     str(d / "words.txt"), "-q"]) == 0
    (d / "crafted_run" / "record.json").unlink()

    class Crafted:
        def __reduce__(self):
            return (os.makedirs, ("pwned",))

    step = next((d / "crafted_run" / "checkpoint").glob("step-*"))
    torch.save({"cpu": Crafted()}, step / "rank0.pt")
    shutil.rmtree(d / "pwned", ignore_errors=True)


def _data_format_files(d: Path) -> None:
    """The token files, tokenizer and parquet file of the data-format rows (112-115, 121-122)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trainplan.executor.data.corpus import train_tokenizer

    np.save(d / "tokens_i64.npy", np.arange(1000, dtype=np.int64))
    np.arange(8000, 9000, dtype=np.uint32).tofile(d / "tokens_big.bin")
    (np.arange(1000, dtype=np.uint32) % 300).tofile(d / "tokens_u32.bin")
    np.save(d / "tokens_u16.npy", np.arange(1000, dtype=np.uint16))
    train_tokenizer([_words(50, 3)], 300).save(str(d / "tok300.json"))
    pq.write_table(pa.table({"content": ["a document"] * 3, "id": [1, 2, 3]}), d / "rows.parquet")


def _spy_main(argv: list[str], monkeypatch) -> tuple[int, BaseException | None]:
    """`cli.main(argv)` and the exception its command raised (None if none)."""
    seen: dict = {"exc": None}
    real = cli.build_parser

    def build():
        ap = real()
        parse = ap.parse_args

        def parse_args(args=None, namespace=None):
            ns = parse(args, namespace)
            fn = ns.fn

            def wrapped(a):
                try:
                    return fn(a)
                except BaseException as e:
                    seen["exc"] = e
                    raise
            ns.fn = wrapped
            return ns

        ap.parse_args = parse_args
        return ap

    monkeypatch.setattr(cli, "build_parser", build)
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse usage errors
        rc, seen["exc"] = e.code, e
    return rc, seen["exc"]


def one_error_line(err: str) -> str:
    """The one error line of `err`, less the training progress lines a run prints before it
    (`trainplan.executor.measure.LogProgress`: stderr is not a terminal here)."""
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("train: step ")]
    assert "Traceback" not in err, err
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{err}"
    assert lines[0].startswith("trainplan: error: "), lines[0]
    return lines[0]


# id -> (argv, error type, needles the line must hold: the bad value and what is valid).
# SystemExit: an argparse usage error (exit 2 too, one line).
LR_ABSURD = "decisions.lr=1000000.0 must be a finite number in (0, 10]"
CLI_ROWS: dict[str, tuple[str, type, list[str]]] = {
    # ---- solve: names, budget, sizes
    "unknown-hw": ("solve --model tiny-llama --hw h800 --budget-seconds 60", UnknownNameError,
                   ["'h800'", "a100", "h100", "h200", "mi300x", "cpu"]),
    "unknown-preset": ("solve --model llama9-1t --hw h100 --budget-seconds 60", UnknownNameError,
                       ["'llama9-1t'", "llama3-70b", "tiny-llama", "or give a transformers config.json"]),
    "zero-budget": (f"{TINY} --budget-seconds 0", BudgetError, ["wall_clock_s=0.0", "positive finite"]),
    "negative-budget": (f"{TINY} --budget-device-hours -1", BudgetError,
                        ["device_hours=-1.0", "positive finite"]),
    "nan-budget": (f"{TINY} --budget-flops nan", BudgetError, ["flops=nan", "positive finite"]),
    "huge-flops": (f"{TINY} --budget-flops 1e300", BudgetError, ["flops=1e+300", "at most 1e+30"]),
    "global-batch-zero": (f"{TINY} --budget-seconds 60 --global-batch-tokens 0", BudgetError,
                          ["global_batch_tokens=0", "whole number of tokens per optimizer step"]),
    "global-batch-indivisible": (f"{TINY} --budget-seconds 60 --global-batch-tokens 1000", BudgetError,
                                 ["global_batch_tokens=1000", "dp_degree x micro_batch x seq_len x grad_accum",
                                  "nearest valid global batches are 896 and 1024 tokens"]),
    "max-seq-len-with-frontier": ("solve --model tiny-llama --hw cpu --budget-seconds 60 --max-seq-len --frontier",
                                  TrainplanError, ["--max-seq-len and --frontier cannot be combined", "leave one out"]),
    "activation-bits-unknown": (f"{TINY} --budget-seconds 60 --activation-bits 32,4", TrainplanError,
                                ["activation_bits=4", "32, 16, 8"]),
    "optimizer-bits-for-precision": (f"{TINY} --budget-seconds 60 --optimizer-bits 16", TrainplanError,
                                     ["optimizer_bits=16", "precision='fp32'", "32, 8, 4"]),
    "bits-not-a-list": (f"{TINY} --budget-seconds 60 --optimizer-bits eight", TrainplanError,
                        ["--optimizer-bits 'eight'", "e.g. 32,8"]),
    "curve-missing-file": (f"{TINY} --budget-seconds 60 --heldout-curve no_such_curve.json "
                           "--loss-value-device-hours-per-nat 1", TrainplanError,
                           ["'no_such_curve.json'", "No such file", "HeldoutCurve.to_dict()"]),
    "curve-not-a-curve": (f"{TINY} --budget-seconds 60 --heldout-curve garbage.json "
                          "--loss-value-device-hours-per-nat 1", TrainplanError,
                          ["'garbage.json': not a held-out curve", "HeldoutCurve.to_dict()"]),
    "curve-gain-out-of-range": (f"{TINY} --budget-seconds 60 --heldout-curve curve_gain.json "
                                "--loss-value-device-hours-per-nat 1", TrainplanError,
                                ["cooldown_gain_nats=1000000000.0 must be a finite number in [-1, 1]"]),
    "curve-out-of-range": (f"{TINY} --budget-seconds 60 --heldout-curve curve_neg.json "
                           "--loss-value-device-hours-per-nat 1", TrainplanError,
                           ["'curve_neg.json': gamma=-0.03 must be a finite number in [0, 100]",
                            "HeldoutCurve.to_dict()"]),
    "curve-of-another-model": (f"{TINY} --budget-seconds 60 --heldout-curve curve_8b.json "
                               "--loss-value-device-hours-per-nat 1", TrainplanError,
                               ["fitted on pilots of llama3-8b (vocabulary 128256)",
                                "the plan is tiny-llama (vocabulary 8192)", "fit pilots of this model"]),
    "loss-value-zero": (f"{TINY} --budget-seconds 60 --loss-value-device-hours-per-nat 0", TrainplanError,
                        ["--loss-value-device-hours-per-nat 0.0", "finite number > 0"]),
    "json-empty": (f"{TINY} --budget-seconds 60 --json ''", OutputPathError, ["--json is empty"]),
    "curve-without-value": (f"{TINY} --budget-seconds 60 --heldout-curve garbage.json", TrainplanError,
                            ["--heldout-curve predicts the governor's stop",
                             "--loss-value-device-hours-per-nat V"]),
    "huge-seconds": (f"{TINY} --budget-seconds 1e300", BudgetError,
                     ["wall_clock_s=1e+300", "at most 1e+09 s"]),
    "huge-device-hours": (f"{TINY} --budget-device-hours 1e300", BudgetError,
                          ["device_hours=1e+300", "at most 2.778e+05 on 1 device"]),
    "negative-budget-e-notation": (f"{TINY} --budget-seconds -1e3", BudgetError,
                                   ["wall_clock_s=-1000.0", "positive finite"]),
    "zero-devices": (f"{TINY} --devices 0 --budget-seconds 60", BudgetError, ["devices=0", ">= 1"]),
    "too-many-devices": (f"{TINY} --devices 1000000000 --budget-seconds 60", BudgetError,
                         ["devices=1000000000", "from 1 to 1,000,000"]),
    "zero-seq-len": ("solve --model tiny-llama --hw cpu --seq-len 0 --budget-seconds 60", TrainplanError,
                     ["seq_len=0", "positive whole number"]),
    "negative-seq-len": ("solve --model tiny-llama --hw cpu --seq-len -5 --budget-seconds 60",
                         TrainplanError, ["seq_len=-5", "positive whole number"]),
    "zero-data-tokens": (f"{TINY} --budget-seconds 60 --data-tokens 0", DataError,
                         ["data_tokens=0", ">= 1"]),
    "negative-data-tokens": (f"{TINY} --budget-seconds 60 --data-tokens -1", DataError,
                             ["data_tokens=-1", ">= 1"]),
    "data-tokens-below-one-sequence": (f"{TINY} --budget-seconds 60 --data-tokens 100", DataError,
                                       ["corpus has 100 tokens", "seq_len + 1 = 129", "seq_len <= 99"]),
    "devices-beyond-corpus": (f"{TINY} --devices 100000 --budget-device-hours 1000 --data-tokens 10000",
                              BudgetError, ["devices=100000", "10,000", "at most 78 devices"]),
    "zero-time-limit": (f"{TINY} --budget-seconds 60 --time-limit 0", BudgetError,
                        ["time limit 0.0 s", "positive finite", "at most 86400"]),
    "negative-time-limit": (f"{TINY} --budget-seconds 60 --time-limit -1", BudgetError,
                            ["time limit -1.0 s", "positive finite"]),
    "nan-time-limit": (f"{TINY} --budget-seconds 60 --time-limit nan", BudgetError,
                       ["time limit nan s", "positive finite"]),
    "negative-seed": (f"{TINY} --budget-seconds 60 --seed -1", BudgetError, ["seed=-1", "0 to 2147483647"]),
    "json-missing-folder": (f"{TINY} --budget-seconds 60 --json no_such_dir/p.json", OutputPathError,
                            ["'no_such_dir/p.json'", "'no_such_dir' does not exist", "existing one"]),
    "json-is-a-folder": (f"{TINY} --budget-seconds 60 --json old_run", OutputPathError,
                         ["'old_run' is a folder", "old_run/plan.json"]),
    # ---- argparse usage errors: one line too
    "missing-budget": (TINY, SystemExit,
                       ["--budget-device-hours --budget-seconds --budget-flops is required"]),
    "two-budgets": (f"{TINY} --budget-seconds 60 --budget-flops 1e15", SystemExit,
                    ["--budget-flops: not allowed with argument --budget-seconds"]),
    "non-integer-devices": (f"{TINY} --budget-seconds 60 --devices x", SystemExit,
                            ["--devices: invalid int value: 'x'"]),
    "unknown-command": ("bogus", SystemExit, ["invalid choice: 'bogus'", "'solve'", "'calibrate'"]),
    "calibrate-no-folders": ("calibrate", SystemExit, ["required: RUN_DIR", "trainplan calibrate --help"]),
    # ---- run: plan, output folder, device
    "missing-plan-file": ("run no_such_plan.json --out out", PlanMismatchError,
                          ["cannot read plan 'no_such_plan.json'", "No such file"]),
    "corrupt-plan-file": ("run garbage.json --out out", PlanMismatchError,
                          ["cannot read plan 'garbage.json'", "trainplan solve --json"]),
    "plan-format-float": ("run plan_format_float.json --out out", PlanMismatchError,
                          ["not a trainplan plan of format 1: got format 1.0"]),
    "plan-seed-huge": ("run plan_seed_huge.json --out out", PlanMismatchError,
                       ["decisions.seed=1180591620717411303424 must be a whole number in [0, 2^63)"]),
    "plan-lr-true": ("run plan_lr_true.json --out out", PlanMismatchError,
                     ["decisions.lr=True must be a finite number in (0, 10]"]),
    "plan-checkpoint-sets-str": ("run plan_sets_str.json --out out", PlanMismatchError,
                                 ["decisions.checkpoint_sets='x' must be an object with a list of strings per key"]),
    "plan-budget-str": ("run plan_budget_str.json --out out", PlanMismatchError,
                        ["budget='x' must be an object with a finite number per key"]),
    "plan-format-true": ("run plan_format_true.json --out out", PlanMismatchError,
                         ["not a trainplan plan of format 1: got format True"]),
    "plan-wrong-format": ("run plan_format_2.json --out out", PlanMismatchError,
                          ["not a trainplan plan of format 1: got format 2", "trainplan solve --json"]),
    "plan-field-corrupt": ("run plan_bad_field.json --out out", PlanMismatchError,
                           ["decisions.seq_len='abc'", "whole number >= 1", "solve it again"]),
    "plan-sp-inconsistent": ("run plan_bad_sp.json --out out", PlanMismatchError,
                             ["sp_degree=3 x dp_degree=1 must equal devices=1"]),
    "plan-bits-not-whole": ("run plan_bits_float.json --out out", PlanMismatchError,
                            ["decisions.activation_bits=8.0", "32, 16 or 8"]),
    "plan-governor-not-a-number": ("run plan_gov_str.json --out out", PlanMismatchError,
                                   ["decisions.governor_threshold='x'", "finite number >= 0"]),
    "plan-warmup-past-budget": ("run plan_warmup.json --out out", PlanMismatchError,
                                ["warmup_steps=1000 must be at most max_steps=2"]),
    "plan-decisions-edited": ("run plan_mb_edited.json --out out", PlanMismatchError,
                              ["predictions.tokens_per_step=128 is not micro_batch=100000",
                               "edited after the predictions"]),
    "plan-checkpoint-edited": ("run plan_ckpt_edited.json --out out", PlanMismatchError,
                               ['decisions.activation_checkpoint=["full", "full", "full", "full"] '
                                '(predicted for ["none"',
                                "edited after the predictions"]),
    "plan-step-time-negative": ("run plan_step_time.json --out out", PlanMismatchError,
                                ["predictions.step_time_s=-1", "must be a finite number > 0"]),
    "plan-path-empty": ("run '' --out out", TrainplanError, ["PLAN is empty", "trainplan solve --json"]),
    "data-empty-path": ("run plan.json --out out --data ''", TrainplanError,
                        ["--data '' has an empty path", "leave --data out"]),
    "report-out-empty": ("report short_run --out ''", OutputPathError, ["--out is empty"]),
    "report-run-empty": ("report ''", TrainplanError, ["a run folder is empty ('')", "trainplan run"]),
    "calibrate-run-empty": ("calibrate ''", TrainplanError, ["a run folder is empty ('')"]),
    "frontier-out-without-frontier": (f"{TINY} --budget-seconds 60 --frontier-out fdir", TrainplanError,
                                      ["--frontier-out 'fdir' is for --frontier", "add --frontier"]),
    "frontier-out-empty": (f"{TINY} --budget-seconds 60 --frontier --frontier-out ''", OutputPathError,
                           ["--frontier-out is empty"]),
    "frontier-out-a-file": (f"{TINY} --budget-seconds 60 --frontier --frontier-out small.txt",
                            OutputPathError, ["--frontier-out 'small.txt' is a file", "give a folder path"]),
    "out-empty": ("run plan.json --out ''", OutputPathError, ["--out is empty", "give a folder path"]),
    "out-not-creatable": ("run plan.json --out /proc/no_such/run", OutputPathError,
                          ["--out '/proc/no_such/run': cannot create the folder", "writable place"]),
    "plan-params-edited": ("run plan_params.json --out out", PlanMismatchError,
                           ["123 parameters", "has 7,096,576", "solve it again"]),
    "plan-for-another-model": ("run plan_8b.json --out out", PlanMismatchError,
                               ["llama3-8b has 7,096,576 parameters", "has 7,046,696,960"]),
    "plan-for-a-user-model": ("run plan_user.json --out out", PlanMismatchError,
                              ["'MyNet'", "not a preset", "tiny-llama", "trainplan.executor.run(plan, model, data)"]),
    "plan-for-an-accelerator": ("run plan_h100.json --out out", DeviceError, ["'h100'", "--device cpu"]),
    "negative-checkpoint-every": ("run nan_plan.json --out ck_out --data words.txt --checkpoint-every -1",
                                  TrainplanError, ["checkpoint_every=-1", "whole number >= 0"]),
    "run-without-plan": ("run --out out", TrainplanError, ["give a PLAN", "--resume"]),
    "out-is-a-file": ("run plan.json --out small.txt", OutputPathError,
                      ["--out 'small.txt' is a file", "folder path"]),
    "out-under-a-file": ("run plan.json --out small.txt/run", OutputPathError,
                         ["'small.txt/run' is under 'small.txt', which is a file"]),
    "out-holds-a-run": ("run plan.json --out old_run", OutputPathError,
                        ["'old_run' already holds a run (record.json)", "--resume", "--overwrite"]),
    "device-cpu-index": ("run plan.json --out out --device cpu:5", DeviceError,
                         ["--device 'cpu:5': the cpu is one device (cpu or cpu:0)", "valid here: cpu"]),
    "device-bogus": ("run plan.json --out out --device bogus", DeviceError,
                     ["--device 'bogus'", "valid here: cpu"]),
    "device-cuda-without-gpu": ("run plan.json --out out --device cuda", DeviceError,
                                ["--device 'cuda'", "no CUDA/ROCm device", "valid here: cpu"]),
    "device-unsupported-type": ("run plan.json --out out --device mps", DeviceError,
                                ["--device 'mps'", "cpu or cuda"]),
    # ---- run: corpus
    "corpus-missing": ("run plan.json --out out --data no_such.txt", DataError,
                       ["no_such.txt does not exist", ".txt/.jsonl"]),
    "corpus-unsupported-extension": ("run plan.json --out out --data notes.csv", DataError,
                                     ["'.csv'", ".txt", ".jsonl"]),
    "corpus-empty": ("run plan.json --out out --data empty.txt", DataError, ["empty.txt is empty"]),
    "corpus-not-utf8": ("run plan.json --out out --data bad.txt", DataError,
                        ["bad.txt is not UTF-8", "0xff", "re-encode it as UTF-8"]),
    "corpus-below-one-sequence": ("run plan.json --out out --data small.txt", DataError,
                                  ["small.txt has 2 training tokens", "seq_len + 1 = 129"]),
    "corpus-vocab-below-plan": ("run plan.json --out out --data mid.txt", DataError,
                                ["mid.txt gives a vocabulary of 306 tokens", "vocab_size=8192",
                                 "larger corpus"]),
    # ---- demo, report, calibrate
    "demo-out-is-a-file": ("demo --out small.txt", OutputPathError, ["--out 'small.txt' is a file"]),
    "demo-huge-budget": ("demo --out demo_out --budget-flops 1e300", BudgetError,
                         ["flops=1e+300", "at most 1e+30"]),
    "report-missing-folder": ("report no_such_run", TrainplanError,
                              ["'no_such_run' does not exist", "--out folder of `trainplan run`"]),
    "report-not-a-run": ("report old_run", PlanMismatchError,
                         ["cannot read 'old_run/plan.json': No such file or directory",
                          "--out folder of `trainplan run`"]),
    "report-out-is-a-file": ("report old_run --out small.txt", OutputPathError,
                             ["--out 'small.txt' is a file"]),
    "calibrate-missing-folder": ("calibrate no_such_run", TrainplanError,
                                 ["'no_such_run' does not exist", "--out folder"]),
    "calibrate-short-run": ("calibrate short_run", TrainplanError,
                            ["'short_run' has 2 timed steps", "at least 3", "Nothing was written"]),
    # ---- hardware profile files
    "hw-file-missing": ("solve --model tiny-llama --hw missing.toml --budget-seconds 60", TrainplanError,
                        ["'missing.toml' does not exist", "--template h100"]),
    "hw-file-bad-value": ("solve --model tiny-llama --hw bad_profile.toml --budget-seconds 60", TrainplanError,
                          ["'bad_profile.toml'", "memory_efficiency=1.5", "must be a finite number in (0, 1]"]),
    "calibrate-profile-out-missing-folder": ("calibrate short_run --profile-out no_dir/x.toml", OutputPathError,
                                             ["'no_dir/x.toml'", "existing folder"]),
    # ---- export
    "export-target-without-the-model": ("export plan.json --to torchtitan", TrainplanError,
                                        ["torchtitan 0.2.2 has no model for 'tiny-llama'", "llama3.1-8b (llama3/8B)",
                                         "--to deepspeed or --to accelerate"]),
    "export-unknown-target": ("export plan.json --to megatron", SystemExit,
                              ["--to: invalid choice: 'megatron'", "'torchtitan', 'deepspeed', 'accelerate'"]),
    "export-substitute-does-not-fit": ("export plan_tight.json --to torchtitan", ExportMemoryError,
                                       ["torchtitan runs optimizer_bits=32", "77.36 GiB per device",
                                        "(the plan: 55.04 GiB)", "77.00 GiB usable", "--force"]),
    "export-cannot-reprice": ("export plan_tight_70b.json --to deepspeed", TrainplanError,
                              ["cannot re-check the memory of the deepspeed export",
                               "activation_checkpoint has 32 entries; llama3-70b has 80 layers", "--force"]),
    "export-profile-file-plan-without-its-file": ("export plan_tight_cal.json --to accelerate", UnknownNameError,
                                                  ["unknown hardware 'h100-cal'", "h100, h200",
                                                   "give export the same --hw FILE.toml"]),
    "export-hw-of-another-profile": ("export plan_tight_cal.json --to accelerate --hw h100", PlanMismatchError,
                                     ["--hw 'h100' is profile 'h100'", "made for 'h100-cal'",
                                      "the profile file the plan was solved with"]),
    # ---- weights out
    "export-weights-no-checkpoint": ("export-weights short_run --out w", TrainplanError,
                                     ["run folder 'short_run' has no checkpoint", "checkpoint/latest",
                                      "trainplan run short_run/plan.json --out DIR"]),
    "export-weights-out-not-empty": ("export-weights short_run --out old_run", OutputPathError,
                                     ["--out 'old_run' is not empty", "record.json", "new or empty folder"]),
    # ---- data formats: token files, the model's tokenizer, datasets columns
    "token-file-dtype": ("run plan.json --out out --data tokens_i64.npy", DataError,
                         ["tokens_i64.npy holds int64 ids", "valid: uint16, uint32"]),
    "token-file-ids-beyond-vocab": ("run plan.json --out out --data tokens_big.bin --token-dtype uint32",
                                    DataError, ["holds id 8999", "vocab_size=8192: ids 0..8191", "--token-dtype"]),
    "tokenizer-vocab-not-the-plans": ("run plan.json --out out --data mid.txt --tokenizer tok300.json", DataError,
                                      ["tokenizer 'tok300.json' has a vocabulary of", "vocab_size=8192",
                                       "trainplan.planner.api.solve(model, hw, budget, vocab_size=300)"]),
    "token-file-uint32-read-as-uint16": ("run plan.json --out out --data tokens_u32.bin", DataError,
                                         ["tokens_u32.bin looks like uint32 ids read as uint16",
                                          "pass --token-dtype uint32"]),
    "token-dtype-not-the-npy-header": ("run plan.json --out out --data tokens_u16.npy --token-dtype uint32",
                                       DataError, ["--token-dtype uint32 contradicts token file tokens_u16.npy",
                                                   ".npy header says uint16"]),
    "data-without-text-column": ("run plan.json --out out --data rows.parquet", DataError,
                                 ["rows.parquet has no column 'text'", "'content', 'id'", "--text-column"]),
    # ---- model configs: solve --model config.json
    "model-config-missing": ("solve --model no_such_model.json --hw cpu --budget-seconds 60", ModelConfigError,
                             ["model config 'no_such_model.json' does not exist", "config.json file or a folder"]),
    "model-config-not-json": ("solve --model garbage.json --hw cpu --budget-seconds 60", ModelConfigError,
                              ["model config 'garbage.json' is not a JSON file", '{"model_type": "llama"']),
    "model-config-without-type": ("solve --model model_no_type.json --hw cpu --budget-seconds 60", ModelConfigError,
                                  ["'model_no_type.json' has no model_type", "llama, mistral, qwen2"]),
    "model-config-unknown-type": ("solve --model model_unknown.json --hw cpu --budget-seconds 60", ModelConfigError,
                                  ["model_type 'qwen' is not known to transformers", "did you mean", "'qwen2'",
                                   "llama, mistral, qwen2"]),
    "model-config-not-causal-lm": ("solve --model model_t5.json --hw cpu --budget-seconds 60", ModelConfigError,
                                   ["model_type 't5' (T5Config) is not a causal language model",
                                    "llama, mistral, qwen2"]),
    "model-config-folder-without-config": ("solve --model old_run --hw cpu --budget-seconds 60", ModelConfigError,
                                           ["model config 'old_run' is a folder without config.json"]),
    "model-config-encoder": ("solve --model model_bert.json --hw cpu --budget-seconds 60", ModelConfigError,
                             ["model_type 'bert' is an encoder", "would see the future", '"is_decoder": true']),
    # ---- issue #40 items 5, 6, 17: incomplete configs, absurd values, untrusted files
    "model-config-without-sizes": ("solve --model model_sizes.json --hw cpu --budget-seconds 60", ModelConfigError,
                                   ["model config 'model_sizes.json' (llama) leaves out hidden_size, "
                                    "num_attention_heads, vocab_size, intermediate_size", "hidden_size=4096",
                                    "give them in the config"]),
    "resume-a-crafted-checkpoint": ("run --out crafted_run --resume --data words.txt", UnsafeFileError,
                                    ["refusing to load", "rank0.pt': it names os.makedirs",
                                     "resume or export only run folders you or trainplan made"]),
    "solve-lr-absurd": (f"{TINY} --budget-seconds 60 --lr 1e6", TrainplanError,
                        ["--lr 1000000.0", "a finite number in (0, 10]", "LLM peaks are 1e-4 to 1e-2"]),
    "memory-limit-zero": (f"{TINY} --budget-seconds 60 --memory-limit-gib 0", TrainplanError,
                          ["--memory-limit-gib 0.0", "a finite number of GiB > 0", "headroom"]),
    "memory-limit-nan": (f"{TINY} --budget-seconds 60 --memory-limit-gib nan", TrainplanError,
                         ["--memory-limit-gib nan", "a finite number of GiB > 0"]),
    "export-plan-lr-absurd": ("export plan_lr_huge.json --to deepspeed", PlanMismatchError,
                              ["plan 'plan_lr_huge.json'", LR_ABSURD]),
    "run-plan-lr-absurd": ("run plan_lr_huge.json --out out", PlanMismatchError, [LR_ABSURD]),
    "report-plan-lr-absurd": ("report edited_run", PlanMismatchError, ["edited_run/plan.json", LR_ABSURD]),
    "calibrate-plan-lr-absurd": ("calibrate edited_run", PlanMismatchError, ["edited_run/plan.json", LR_ABSURD]),
    "export-weights-plan-lr-absurd": ("export-weights edited_run --out w", PlanMismatchError, [LR_ABSURD]),
    "export-plan-hw-unknown": ("export plan_h800.json --to deepspeed", PlanMismatchError,
                               ["hw='h800' is not a shipped hardware profile (a100, a100-40gb, cpu, h100",
                                "does not record a profile file", "solve --hw FILE.toml"]),
    "run-plan-hw-unknown": ("run plan_h800.json --out out", PlanMismatchError,
                            ["hw='h800' is not a shipped hardware profile"]),
    "export-plan-memory-absurd": ("export plan_mem_huge.json --to deepspeed", PlanMismatchError,
                                  ["predictions.memory_bytes.total=1e+15 is more than one h100 device holds",
                                   "80.0 GiB", "corrupt or edited"]),
    # ---- nodes and launchers (a leading NAME=value sets the environment)
    "nodes-not-dividing-devices": ("run plan.json --out out --nnodes 2 --rdzv-endpoint node0:29500",
                                   PlanMismatchError, ["plan uses 1 device(s), which --nnodes 2 cannot split",
                                                       "--nnodes one of 1", "--devices a multiple of 2"]),
    "nodes-without-endpoint": ("run plan.json --out out --nnodes 2", TrainplanError,
                               ["--nnodes 2 needs --rdzv-endpoint HOST[:PORT]", "e.g. node0:29500"]),
    "world-size-not-the-plans": ("WORLD_SIZE=2 RANK=0 run plan.json --out out", PlanMismatchError,
                                 ["WORLD_SIZE=2 in the environment", "the plan uses 1 device(s)",
                                  "start 1 process(es) in all", "--devices 2"]),
}
NEEDS_NO_GPU = {"device-cuda-without-gpu", "plan-for-an-accelerator"}


@pytest.mark.parametrize("row", list(CLI_ROWS), ids=list(CLI_ROWS))
def test_cli_row(row, workdir, monkeypatch, capsys):
    if row in NEEDS_NO_GPU and CUDA:
        pytest.skip("this machine has a CUDA/ROCm device")
    argv, etype, needles = CLI_ROWS[row]
    monkeypatch.chdir(workdir)
    words = shlex.split(argv)
    while words and "=" in words[0]:  # NAME=value: the environment a launcher (torchrun, SLURM) set
        name, value = words.pop(0).split("=", 1)
        monkeypatch.setenv(name, value)
    rc, exc = _spy_main(words, monkeypatch)
    err = capsys.readouterr().err
    assert rc == 2, f"exit status {rc}, expected 2; stderr: {err}"
    line = one_error_line(err)
    assert isinstance(exc, etype), f"{type(exc).__name__} raised, expected {etype.__name__}: {exc}"
    if etype is not SystemExit:
        assert isinstance(exc, TrainplanError) and str(exc) == line.removeprefix("trainplan: error: ")
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    assert not (workdir / "pwned").exists(), "a crafted pickle ran"


def test_nan_loss(workdir, monkeypatch, capsys, one_thread):
    """`trainplan run nan_plan.json --out nan_out --data words.txt`: lr=10 (the largest a plan
    may hold, `trainplan.planner.plan_schema.LR_MAX`) makes the loss NaN by step 3; the run stops
    at once, keeps its record, exits 1 (a run that failed) with one line."""
    monkeypatch.chdir(workdir)
    rc, exc = _spy_main(["run", "nan_plan.json", "--out", "nan_out", "--data", "words.txt"], monkeypatch)
    line = one_error_line(capsys.readouterr().err)
    assert rc == 1 and isinstance(exc, TrainingDivergedError), (rc, exc)
    assert "nan" in line.lower() and "lower the learning rate" in line and "lr=10.0" in line, line
    rec = RunRecord.from_json(workdir / "nan_out" / "record.json")
    assert rec.stop_reason == "nan" and rec.steps < 8, rec


def test_resuming_a_finished_run_says_so_and_reports_it(workdir, monkeypatch, capsys, one_thread):
    """`trainplan run --out done --resume` on a run that ran its budget out: one line saying it
    already ended and there is nothing to resume, its report again, exit 0; the record is kept."""
    import dataclasses

    from trainplan.planner.plan import Plan

    monkeypatch.chdir(workdir)
    plan = Plan.from_json(workdir / "nan_plan.json")
    plan = dataclasses.replace(plan, decisions=dataclasses.replace(plan.decisions, lr=1e-3, max_steps=2))
    plan.to_json(workdir / "ok_plan.json")
    assert cli.main(["run", "ok_plan.json", "--out", "done", "--data", "words.txt"]) == 0
    before = (workdir / "done" / "record.json").read_text()
    capsys.readouterr()
    assert cli.main(["run", "--out", "done", "--resume", "--data", "words.txt"]) == 0
    out, err = capsys.readouterr()
    assert "already ended (budget after 2 steps); nothing to resume" in err, err
    assert "report:" in out, out
    assert (workdir / "done" / "record.json").read_text() == before


def test_seq_len_rules_out_sp(monkeypatch, capsys):
    """`trainplan solve --model llama3-8b --hw h100 --devices 8 --seq-len 131070
    --budget-device-hours 100`: memory binds because 131070 allows only SP degrees 1 and 2; the
    line says so and names a sequence length that allows 8. The solver is stubbed here (the
    real solve and its explanation take about 20 s; the message is checked by hand in
    docs/bad_inputs.md)."""
    import trainplan.planner.api

    def infeasible(*args, **kwargs):
        raise InfeasibleError("per-device memory binds: the lightest plan needs 135 GiB but h100 "
                              "has 77 GiB usable")

    monkeypatch.setattr(trainplan.planner.api, "solve", infeasible)
    argv = "solve --model llama3-8b --hw h100 --devices 8 --seq-len 131070 --budget-device-hours 100"
    rc, exc = _spy_main(argv.split(), monkeypatch)
    line = one_error_line(capsys.readouterr().err)
    assert rc == 3 and isinstance(exc, InfeasibleError)
    for needle in ("per-device memory binds", "seq_len=131070 limits sp_degree to 1, 2",
                   "divisible by 8, e.g. 131072", "up to 8"):
        assert needle in line, (needle, line)


def test_sp_note_is_empty_when_the_sequence_rules_nothing_out():
    from trainplan.modeling.presets import sp_degree_note

    assert sp_degree_note(n_heads=32, n_kv_heads=8, devices=8, seq_len=131072) == ""
    assert sp_degree_note(n_heads=32, n_kv_heads=8, devices=1, seq_len=131071) == ""
    assert "limits sp_degree to 1, 2, 4" in sp_degree_note(n_heads=64, n_kv_heads=8, devices=8,
                                                           seq_len=100)


# ---------------------------------------------------------------- API rows


from tests.support import Rotary as _Rotary  # noqa: E402 (the fuzz tests' rotary stand-in)


class _Block(nn.Module):
    """A residual MLP block; `branch=True` adds data-dependent control flow (a graph break)."""

    def __init__(self, d: int, branch: bool = False):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.branch = branch

    def forward(self, x, position_embeddings=None, position_ids=None, attention_mask=None, **kw):
        h = self.mlp(x)
        if self.branch and h.sum() > 0:  # needs the tensor's value: not traceable
            h = -h
        return x + h


class ToyLM(nn.Module):
    """A module laid out like an HF causal LM (model.embed_tokens, model.layers, model.norm,
    model.rotary_emb, lm_head, config)."""

    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 2, branch: bool = False):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, d)
        self.model.layers = nn.ModuleList(_Block(d, branch) for _ in range(layers))
        self.model.norm = nn.LayerNorm(d)
        self.model.rotary_emb = _Rotary(8)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.config = types.SimpleNamespace(num_attention_heads=4, num_key_value_heads=4,
                                            hidden_size=d, vocab_size=vocab, head_dim=8)

    def forward(self, input_ids):
        x = self.model.embed_tokens(input_ids)
        for block in self.model.layers:
            x = block(x)
        return self.lm_head(self.model.norm(x))


def _gpt2_positions(n_positions: int) -> nn.Module:
    """A tiny GPT-2 whose learned position table has `n_positions` rows (row 134)."""
    import transformers

    cfg = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=128, n_positions=n_positions,
                                  bos_token_id=None, eos_token_id=None)
    return transformers.GPT2LMHeadModel(cfg)


class EmbedsLM(nn.Module):
    """A model whose forward takes embeddings, not token ids (row 133)."""

    def __init__(self, d: int = 32, vocab: int = 64):
        super().__init__()
        self.layers = nn.ModuleList(_Block(d) for _ in range(2))
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, inputs_embeds):
        for block in self.layers:
            inputs_embeds = block(inputs_embeds)
        return self.lm_head(inputs_embeds)


def _apply_to_another_model(edit) -> None:
    """Rows 108-109: tiny-llama's plan, every layer checkpointed, applied to tiny-llama edited by
    `edit(model)` (`trainplan.executor.apply_plan`)."""
    import trainplan.executor
    from trainplan.modeling.presets import build_model

    plan = plan_for_choice("tiny-llama", "cpu", seq_len=64, micro_batch=1, activation_checkpoint="full", vocab_size=512)
    model = build_model("tiny-llama", device="cpu", vocab_size=512)
    edit(model)
    trainplan.executor.apply_plan(plan, model)


API_ROWS = {
    "sp-not-dividing-seq-len": (
        lambda: plan_for_choice("tiny-llama", "h100", seq_len=100, micro_batch=1, sp_degree=8, devices=8),
        TrainplanError, ["sp_degree=8", "seq_len=100", "valid degrees are [1, 2, 4]"]),
    "sp-not-dividing-heads": (
        lambda: plan_for_choice("tiny-llama", "h100", seq_len=384, micro_batch=1, sp_degree=3, devices=3),
        TrainplanError, ["sp_degree=3", "8 heads", "valid degrees are [1]"]),
    "model-not-a-causal-lm": (
        lambda: solve(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), "h100", Budget(wall_clock_s=60)),
        TrainplanError, ["cannot capture Sequential", "no nn.ModuleList of blocks", "called in order"]),
    "model-graph-break": (
        lambda: solve(ToyLM(branch=True), "h100", Budget(wall_clock_s=60), seq_len=64),
        CaptureError, ["cannot capture ToyLM", "aten._local_scalar_dense", "in model.layers.0 (_Block)",
                       "data-dependent control flow"]),
    "model-takes-no-token-ids": (
        lambda: solve(EmbedsLM(), "h100", Budget(wall_clock_s=60), seq_len=64),
        CaptureError, ["cannot capture EmbedsLM", "torch.int64 values, not hidden states", "takes no token ids"]),
    "model-not-a-module": (
        lambda: solve(42, "h100", Budget(wall_clock_s=60)),
        TrainplanError, ["nn.Module or a preset name", "got int"]),
    "budget-not-a-budget": (
        lambda: solve("tiny-llama", "h100", 3600),
        TrainplanError, ["trainplan.planner.Budget", "got int"]),
    "grad-accum-zero": (
        lambda: plan_for_choice("tiny-llama", "h100", seq_len=64, micro_batch=1, grad_accum=0),
        TrainplanError, ["grad_accum=0", "whole number >= 1"]),
    "global-batch-not-a-number": (
        lambda: solve("tiny-llama", "h100", Budget(wall_clock_s=60), global_batch_tokens=4e6),
        BudgetError, ["global_batch_tokens=4000000.0", "whole number of tokens", "e.g. 4194304"]),
    "apply-plan-other-block": (
        lambda: _apply_to_another_model(lambda m: setattr(m.model.layers[2].mlp, "act_fn", nn.GELU())),
        PlanMismatchError, ["model.layers.2 is not the block the plan was captured from (block0, 38 ops)",
                            "compute op 33 of its forward is aten.gelu.default, the plan expects aten.silu.default",
                            "solve the plan for this model"]),
    "loss-chunks-not-power-of-two": (
        lambda: solve("tiny-llama", "cpu", Budget(wall_clock_s=60), seq_len=128, loss_chunks=(1, 3)),
        TrainplanError, ["loss_chunks=(1, 3) is not valid", "powers of two", "e.g. (1, 8)"]),
    "tiled-mlp-with-selective-entry": (
        lambda: plan_for_choice("tiny-llama", "cpu", seq_len=128, micro_batch=1, activation_checkpoint="save_matmuls",
                                mlp_chunks=4),
        TrainplanError, ["mlp_chunks=4 runs with the checkpoint entries none and full only", "'save_matmuls'"]),
    "seq-past-learned-positions": (
        lambda: plan_for_choice(_gpt2_positions(64), "cpu", seq_len=128, micro_batch=1),
        TrainplanError, ["seq_len=128 is beyond GPT2LMHeadModel's 64 learned positions",
                         "transformer.wpe, an nn.Embedding of 64 rows", "use seq_len <= 64"]),
    "apply-plan-other-layer-count": (
        lambda: _apply_to_another_model(lambda m: setattr(m.model, "layers", m.model.layers[:2])),
        PlanMismatchError, ["the plan has 4 layers but LlamaForCausalLM has no nn.ModuleList of 4 blocks",
                            "model.layers (2)", "apply the plan to the model it was made for"]),
}


@pytest.mark.parametrize("row", list(API_ROWS), ids=list(API_ROWS))
def test_api_row(row):
    call, etype, needles = API_ROWS[row]
    with pytest.raises(etype) as e:
        call()
    msg = str(e.value)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


def test_the_toy_lm_without_a_branch_plans():
    """The graph-break row's model minus the branch is planned: the error is the branch."""
    plan = solve(ToyLM(), "h100", Budget(wall_clock_s=60), seq_len=64, policies=("none", "full"))
    assert plan.model == "ToyLM" and plan.decisions.max_steps >= 1


def test_every_row_is_in_the_table():
    """docs/bad_inputs.md has one row per test here (its last column names the test), and no
    row without a test."""
    import re

    table = (Path(__file__).resolve().parents[2] / "docs" / "bad_inputs.md").read_text()
    tests = ({f"test_cli_row[{r}]" for r in CLI_ROWS} | {f"test_api_row[{r}]" for r in API_ROWS}
             | {"test_nan_loss", "test_seq_len_rules_out_sp"})
    listed = re.findall(r"^\|.*\| *`(test_\w+(?:\[[a-z0-9-]+\])?)` *\|$", table, flags=re.MULTILINE)
    assert len(listed) == len(set(listed)), "a test is listed twice"
    assert tests == set(listed), (f"missing from the table: {sorted(tests - set(listed))}; "
                                  f"in the table but not tested: {sorted(set(listed) - tests)}")
    assert len(tests) >= 25


def test_a_plan_solved_with_a_profile_file_loads(workdir, monkeypatch, capsys):
    """Issue #40 item 6: an `hw` that is not a shipped profile is accepted where the plan records
    the profile file it was solved with (`solve --hw FILE.toml` writes options.hw_profile_file):
    the plan exports; the same plan without that record is refused."""
    from trainplan.hardware_profiles import load
    from trainplan.hardware_profiles.profile_file import profile_toml
    from trainplan.planner.plan import Plan

    monkeypatch.chdir(workdir)
    text = profile_toml(load("h100")).replace('name = "h100"', 'name = "my-gpu"')
    Path("my-gpu.toml").write_text(text)
    assert cli.main(["solve", "--model", "tiny-llama", "--hw", "my-gpu.toml", "--seq-len", "128",
                     "--budget-seconds", "60", "--json", "plan_my_gpu.json", "-q"]) == 0
    plan = Plan.from_json("plan_my_gpu.json")
    assert plan.hw == "my-gpu" and plan.options["hw_profile_file"] == "my-gpu.toml"
    assert cli.main(["export", "plan_my_gpu.json", "--to", "deepspeed", "--out", "ds.json", "-q"]) == 0
    raw = json.loads(Path("plan_my_gpu.json").read_text())
    del raw["options"]["hw_profile_file"]
    Path("plan_my_gpu_bare.json").write_text(json.dumps(raw))
    capsys.readouterr()
    assert cli.main(["export", "plan_my_gpu_bare.json", "--to", "deepspeed"]) == 2
    assert "hw='my-gpu' is not a shipped hardware profile" in one_error_line(capsys.readouterr().err)
