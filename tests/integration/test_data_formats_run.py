"""`trainplan run --data` on a pre-tokenized token file (the .txt path's ids) and on a parquet file of
the same text with the model's own tokenizer train alike, loss for loss (issue #21 item 4)."""

from __future__ import annotations

import random

import numpy as np
import pytest

import trainplan.planner.cli.main as cli
from trainplan.executor.data.batches import load_corpus
from trainplan.executor.record import RunRecord
from trainplan.planner.api import plan_for_choice

pa = pytest.importorskip("pyarrow")  # with datasets (extra `data`)
pq = pytest.importorskip("pyarrow.parquet")

WORDS = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler", "in", "mind",
         "suffer", "slings", "and", "arrows", "of", "outrageous", "fortune"]


def test_token_file_and_parquet_train_as_the_text(tmp_path, monkeypatch, cpu_profile, one_thread):
    rng = random.Random(0)
    docs = ["\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(8)) for _ in range(60)]
    monkeypatch.setenv("TRAINPLAN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text("\n\n".join(docs))
    text = load_corpus(["corpus.txt"], vocab_size=400)  # today's path: a BPE trained on the text
    plan = plan_for_choice("tiny-llama", cpu_profile, seq_len=64, micro_batch=2, max_steps=3,
                           vocab_size=text.vocab_size)
    plan.to_json("plan.json")
    np.concatenate([text.train_tokens, text.heldout_tokens]).astype(np.uint16).tofile("train.bin")
    pq.write_table(pa.table({"text": ["\n\n".join(docs)]}), "corpus.parquet")  # one row: the .txt document
    # the .bin holds the .txt path's ids; the parquet row is the .txt's text, tokenized by --tokenizer
    runs = {"bin": ["--data", "train.bin"],
            "parquet": ["--data", "corpus.parquet", "--tokenizer", text.tokenizer_path]}
    losses = {}
    for name, data in runs.items():
        assert cli.main(["run", "plan.json", "--out", name, "--quiet", *data]) == 0, name
        rec = RunRecord.from_json(tmp_path / name / "record.json")
        assert rec.steps == 3
        losses[name] = (rec.train_loss, rec.heldout_loss)
    assert losses["bin"] == losses["parquet"] and len(losses["bin"][0]) == 3
