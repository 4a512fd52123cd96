"""Issue #40, item 12: a plain `trainplan solve` and a short `trainplan run` print no raw Python
warning (`file.py:N: UserWarning: ...` with its source line). Known ones go to the log at debug
level: trainplan's own note on tied embeddings (`trainplan.planner.capture.graph`) and torch's
mod_tracker warning on a checkpointed block's recompute (`trainplan.executor.measure`); `-vv`
shows them."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from trainplan.planner.api import plan_for_choice

QWEN_TIED = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": True,
             "max_position_embeddings": 256}
"""A Qwen2 with tied input and output embeddings: its capture once warned about them."""


def _cli(*argv: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainplan", *argv], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)


def _no_warning(stderr: str) -> None:
    assert "Warning:" not in stderr and "warnings.warn" not in stderr, stderr


def test_a_tied_model_solves_without_a_warning(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_TIED))
    proc = _cli("solve", "--model", "config.json", "--hw", "h100", "--devices", "8", "--seq-len", "256",
                "--budget-device-hours", "1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    _no_warning(proc.stderr)
    debug = _cli("-vv", "solve", "--model", "config.json", "--hw", "h100", "--seq-len", "256",
                 "--budget-device-hours", "1", cwd=tmp_path)
    assert "tied embeddings" in debug.stderr, debug.stderr[-2000:]


@pytest.mark.slow
def test_a_checkpointed_run_prints_no_warning(tmp_path, cpu_profile):
    rng = random.Random(3)  # made-up words: enough distinct pairs for a 512-token BPE
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7))) for _ in range(3000)]
    (tmp_path / "words.txt").write_text("\n".join(" ".join(rng.choice(words) for _ in range(15))
                                                  for _ in range(800)) + "\n", encoding="utf-8")
    plan = plan_for_choice("tiny-llama", cpu_profile, seq_len=64, micro_batch=1, max_steps=4,
                           activation_checkpoint="full", vocab_size=512)
    plan.to_json(tmp_path / "plan.json")
    proc = _cli("run", "--data", "words.txt", "plan.json", "--out", "run", "--device", "cpu", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    _no_warning(proc.stderr)
