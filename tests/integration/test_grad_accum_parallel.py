"""Gradient accumulation on two gloo processes with DDP (ZeRO 0, its all-reduce deferred with
`no_sync` to the last micro-step): two micro-steps of one sequence per rank train what one
process accumulating four micro-steps of one sequence trains (the same four windows per step:
`trainplan.executor.data.batches.TokenBatches` hands each micro-step the next micro-batch of the stream;
tests/unit/executor/test_grad_accum.py shows that equal to one step of four sequences), by the
held-out loss after two optimizer steps (fp32; the held-out batches are the micro-batch's, so
both runs evaluate the same windows). FSDP2's accumulation, a reduce-scatter every micro-step,
is checked on tests/integration/test_resume.py's two-process run (one launch fewer)."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from trainplan.executor.data.batches import load_corpus
from trainplan.executor.record import RunRecord
from trainplan.executor.train import run
from trainplan.planner.api import plan_for_choice
from trainplan.planner.plan import Plan, layout_fields

SEQ = 64
STEPS = 2
RTOL = 1e-5
WORDS = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler", "in",
         "mind", "suffer", "slings", "and", "arrows", "of", "outrageous", "fortune"]


@pytest.fixture(scope="module")
def corpus_path(tmp_path_factory):
    rng = random.Random(2)
    path = tmp_path_factory.mktemp("corpus") / "words.txt"
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(15)) for _ in range(600)) + "\n",
                    encoding="utf-8")
    return path


def _with(plan: Plan, **decisions) -> Plan:
    """`plan` with `decisions` changed, its tokens per step and `made_for` following them (the
    memory and time predictions stay: these runs compare losses)."""
    d = dataclasses.replace(plan.decisions, **decisions)
    tps = d.dp_degree * d.micro_batch * d.seq_len * d.grad_accum
    d = dataclasses.replace(d, max_tokens=STEPS * tps)
    p = dataclasses.replace(plan.predictions, tokens_per_step=tps, total_tokens=STEPS * tps,
                            made_for=layout_fields(d))
    return dataclasses.replace(plan, decisions=d, predictions=p)


@pytest.fixture(scope="module")
def records(corpus_path, cpu_profile, tmp_path_factory, one_thread) -> dict[str, RunRecord]:
    from trainplan.executor.worker import launch

    corpus = load_corpus([corpus_path], vocab_size=512)
    base = plan_for_choice("tiny-llama", cpu_profile, seq_len=SEQ, micro_batch=1, grad_accum=2, devices=2,
                           max_steps=STEPS, vocab_size=corpus.vocab_size, optimizer_bits=32)
    out = {}
    whole = _with(base, devices=1, dp_degree=1, grad_accum=4)
    out["one process"] = run(whole, data=corpus, out=tmp_path_factory.mktemp("one"), device="cpu",
                             progress=False, checkpoint_every=0, check_fits=False)
    folder = tmp_path_factory.mktemp("ddp")
    _with(base, zero_stage=0).to_json(folder / "plan.json")
    launch(folder / "plan.json", folder / "run", [str(corpus_path)], "cpu", check_fits=False)
    out["ddp"] = RunRecord.from_json(folder / "run" / "record.json")
    return out


@pytest.mark.slow
def test_two_micro_steps_on_two_ranks_train_the_one_process_batch(records):
    one, two = records["one process"], records["ddp"]
    assert two.world_size == 2 and two.steps == one.steps == STEPS and two.stop_reason == "budget"
    assert two.tokens == one.tokens == STEPS * 4 * SEQ
    assert math.isclose(two.final_heldout_loss, one.final_heldout_loss, rel_tol=RTOL), \
        (two.final_heldout_loss, one.final_heldout_loss)


@pytest.mark.slow
def test_two_process_ddp_checkpoint_exports_to_transformers(records, corpus_path, tmp_path):
    """`trainplan export-weights` on the DDP run's checkpoint (the wrapped model's state, written
    by two ranks), in one process: transformers loads the folder and its held-out loss is the
    run's final one."""
    from pathlib import Path

    from tests.support import transformers_heldout_loss
    from trainplan.executor.weights.export import export_weights

    ddp = records["ddp"]
    run_dir = Path(ddp.checkpoint).parents[1]  # RUN_DIR/checkpoint/step-N
    plan = Plan.from_json(run_dir / "plan.json")
    out = export_weights(run_dir, tmp_path / "hf")
    data = load_corpus([corpus_path], vocab_size=plan.vocab_size)  # the run's own (`trainplan.executor.worker.launch`)
    assert math.isclose(transformers_heldout_loss(out, plan, data), ddp.final_heldout_loss, rel_tol=RTOL), \
        ddp.final_heldout_loss
