"""Interrupted and resumed runs: a run stopped after step 4 and resumed from its checkpoint
trains on the same batches with the same learning rates and reaches the same losses as an
uninterrupted run (fp32 and bitsandbytes 8-bit AdamW on one process; FSDP2 sharded state on two);
the stopped run's record and checkpoint are complete; a kill during a checkpoint write leaves
the previous checkpoint valid. The two-process runs also check `trainplan run` (moved here from
tests/unit/executor/test_train.py: its uninterrupted run is the reference of the resume). The
stopped and the FSDP2 checkpoints export to transformers (`trainplan.executor.weights.export`)."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pytest
import torch

from trainplan.executor.checkpoint import CHECKPOINT_DIR, LATEST, latest_checkpoint, load_checkpoint
from trainplan.executor.data.batches import load_corpus
from trainplan.executor.optimizers import build_optimizer
from trainplan.executor.record import RunRecord
from trainplan.executor.train import run
from trainplan.modeling.presets import build_model
from trainplan.planner.api import plan_for_choice

STEPS = 8
STOP_AFTER = 4
RTOL = 1e-6
WORDS = ["the", "king", "is", "dead", "long", "live", "the", "queen", "now", "is", "the", "winter", "of",
         "our", "discontent", "made", "glorious", "summer", "by", "this", "sun", "of", "york", "and", "all",
         "the", "clouds", "that", "lowered", "upon", "our", "house"]


@pytest.fixture(scope="module")
def corpus_path(tmp_path_factory) -> Path:
    rng = random.Random(1)
    path = tmp_path_factory.mktemp("corpus") / "tiny.txt"
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(15)) for _ in range(600))
                    + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def corpus(corpus_path):
    return load_corpus([corpus_path], vocab_size=512)


@pytest.fixture(scope="module")
def make_plan(corpus, cpu_profile):
    """`make_plan(**knobs)`: a fixed tiny-llama plan of STEPS steps for the corpus (the session's
    cpu profile passed in, so that no other thread count measures its own)."""
    def make(**knobs):
        return plan_for_choice("tiny-llama", cpu_profile, seq_len=64, micro_batch=2,
                               max_steps=STEPS, vocab_size=corpus.vocab_size, **knobs)

    return make


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=RTOL)


def assert_same_losses(resumed: RunRecord, full: RunRecord) -> None:
    assert [s for s, _ in resumed.train_loss] == list(range(STEPS)), resumed.train_loss
    bad = [(s, a, b) for (s, a), (_, b) in zip(resumed.train_loss, full.train_loss, strict=False) if not _close(a, b)]
    assert not bad, f"(step, resumed, uninterrupted) train losses differ: {bad}"
    assert [h[:2] for h in resumed.heldout_loss] == [h[:2] for h in full.heldout_loss]
    got, want = resumed.final_heldout_loss, full.final_heldout_loss
    assert _close(got, want), f"final held-out loss resumed {got!r}, uninterrupted {want!r}"


@pytest.fixture(scope="module")
def uninterrupted(make_plan, corpus, tmp_path_factory, one_thread):
    """`uninterrupted(bits)`: the record of the plan with that optimizer width run in one go
    (cached)."""
    cache = {}

    def get(bits: int) -> RunRecord:
        if bits not in cache:
            out = tmp_path_factory.mktemp(f"full{bits}")
            cache[bits] = run(make_plan(optimizer_bits=bits), data=corpus, out=out,
                              device="cpu", progress=False)
        return cache[bits]

    return get


@pytest.fixture(scope="module", params=[32, 8], ids=["adamw32", "adamw8bit"])
def runs(request, make_plan, corpus, tmp_path_factory, uninterrupted):
    """(plan, uninterrupted record, stopped-run folder copy, stopped model, resumed record)."""
    torch.use_deterministic_algorithms(True)
    try:
        plan = make_plan(optimizer_bits=request.param)
        base = tmp_path_factory.mktemp(f"bits{request.param}")
        full = uninterrupted(request.param)
        model = build_model(plan.model, device="cpu", vocab_size=corpus.vocab_size,
                            seed=plan.decisions.seed)
        stopped = run(plan, model, corpus, out=base / "run", device="cpu", progress=False,
                      stop_after_steps=STOP_AFTER)
        assert stopped.stop_reason == "interrupted", stopped.stop_reason
        shutil.copytree(base / "run", base / "stopped")  # the resume below appends in place
        resumed = run(plan, data=corpus, out=base / "run", device="cpu", progress=False, resume=True)
    finally:
        torch.use_deterministic_algorithms(False)
    return plan, full, base / "stopped", model, resumed


def test_resumed_run_reaches_the_same_losses(runs):
    plan, full, _, _, resumed = runs
    assert full.stop_reason == resumed.stop_reason == "budget", (full.stop_reason, resumed.stop_reason)
    assert resumed.steps == STEPS and resumed.tokens == full.tokens, (resumed.steps, resumed.tokens)
    assert_same_losses(resumed, full)
    assert any(f"resumed at step {STOP_AFTER}" in n for n in resumed.notes), resumed.notes
    assert resumed.flops_per_step == full.flops_per_step
    assert resumed.peak_memory_bytes == full.peak_memory_bytes


def test_stopped_record_is_complete(runs):
    _, full, stopped_dir, _, _ = runs
    rec = RunRecord.from_json(stopped_dir / "record.json")
    assert rec.stop_reason == "interrupted" and rec.steps == STOP_AFTER, (rec.stop_reason, rec.steps)
    assert rec.train_loss == full.train_loss[:STOP_AFTER], (rec.train_loss, full.train_loss)
    assert rec.heldout_loss == full.heldout_loss[:STOP_AFTER], rec.heldout_loss
    assert len(rec.step_times_s) == STOP_AFTER - 2, rec.step_times_s  # steps 2, 3 measure
    assert rec.peak_memory_bytes and rec.flops_per_step > 0
    assert Path(rec.checkpoint).name == f"step-{STOP_AFTER:06d}", rec.checkpoint
    assert any("stop_after_steps" in n for n in rec.notes), rec.notes


def test_stopped_checkpoint_is_complete(runs, corpus):
    plan, _, stopped_dir, trained, _ = runs
    path = latest_checkpoint(stopped_dir)
    assert path is not None and path.name == f"step-{STOP_AFTER:06d}", path
    assert (stopped_dir / CHECKPOINT_DIR / LATEST).read_text().strip() == path.name
    assert not list((stopped_dir / CHECKPOINT_DIR).glob("*.tmp")), "temporary left behind"
    fresh = build_model(plan.model, device="cpu", vocab_size=corpus.vocab_size, seed=123)
    opt = build_optimizer(fresh.parameters(), bits=plan.decisions.optimizer_bits, lr=plan.decisions.lr)
    meta = load_checkpoint(path, fresh, opt, dev=torch.device("cpu"))
    assert meta["steps"] == STOP_AFTER and meta["world_size"] == 1, meta["steps"]
    assert meta["record"] == RunRecord.from_json(stopped_dir / "record.json")
    assert meta["plan"]["decisions"] == json.loads(plan.to_json())["decisions"]
    for (name, p), q in zip(trained.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q), f"{name} differs after loading the checkpoint"
    assert len(opt.state) == len(list(fresh.parameters())), "optimizer state missing"



def test_stopped_run_exports_to_transformers(runs, corpus, tmp_path):
    """An interrupted run's checkpoint exports (`trainplan export-weights`; the optimizer state,
    8-bit or not, is left out): transformers' model gives the stopped model's logits."""
    from transformers import AutoModelForCausalLM

    from trainplan.executor.weights.export import export_weights

    _, _, stopped_dir, trained, _ = runs
    loaded = AutoModelForCausalLM.from_pretrained(export_weights(stopped_dir, tmp_path / "hf"))
    x = torch.tensor(corpus.heldout_tokens[:64].tolist()).reshape(1, 64)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, trained.eval()(input_ids=x).logits, rtol=0, atol=0)

def test_a_kill_during_a_checkpoint_write_keeps_the_previous_one(make_plan, corpus, tmp_path,
                                                                 monkeypatch, uninterrupted):
    """Checkpoint every 2 steps; the third write (after step 6) dies half-way: `latest` still
    names step 4, which resumes to the uninterrupted losses."""
    import torch.distributed.checkpoint as dcp

    plan, full = make_plan(), uninterrupted(32)
    real_save, calls = dcp.save, []

    def dying_save(state, checkpoint_id):
        calls.append(checkpoint_id)
        if len(calls) == 3:
            (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half")
            raise OSError("killed during the write")
        return real_save(state, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(dcp, "save", dying_save)
    with pytest.raises(OSError, match="killed during the write"):
        run(plan, data=corpus, out=tmp_path / "run", device="cpu", progress=False, checkpoint_every=2)
    monkeypatch.setattr(dcp, "save", real_save)
    rec = RunRecord.from_json(tmp_path / "run" / "record.json")
    assert rec.stop_reason == "error" and rec.steps == 6, (rec.stop_reason, rec.steps)
    assert latest_checkpoint(tmp_path / "run").name == "step-000004"
    resumed = run(plan, data=corpus, out=tmp_path / "run", device="cpu", progress=False, resume=True)
    assert_same_losses(resumed, full)
    assert not list((tmp_path / "run" / CHECKPOINT_DIR).glob("step-*.tmp"))


# ---------------------------------------------------------------- two processes


@pytest.fixture(scope="module")
def two_process(corpus, corpus_path, cpu_profile, tmp_path_factory):
    """SP 2 x ZeRO stage 2 (FSDP2, every parameter sharded over both ranks) with two
    accumulated micro-steps of one sequence per optimizer step, on two gloo processes, three
    torchrun launches shared by the tests below: the whole run through `trainplan run` (folder
    `full`), the same plan stopped after step 3 (`trainplan.executor.worker.launch`, folder `run`; its
    record and checkpoint shards read before) and resumed in place.
    Returns (plan, full folder, stopped record, stopped checkpoint's files, resumed folder)."""
    import subprocess
    import sys

    from trainplan.executor.worker import launch

    base = tmp_path_factory.mktemp("two_process")
    plan = plan_for_choice("tiny-llama", cpu_profile, seq_len=64, micro_batch=1, grad_accum=2, max_steps=8,
                           vocab_size=corpus.vocab_size, data_tokens=corpus.n_train_tokens, devices=2,
                           sp_degree=2, zero_stage=2, optimizer_bits=32)
    plan.to_json(base / "plan.json")
    proc = subprocess.run([sys.executable, "-m", "trainplan", "run", str(base / "plan.json"),
                           "--out", str(base / "full"), "--data", str(corpus_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, \
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    data = [str(corpus_path)]
    launch(base / "plan.json", base / "run", data, "cpu", stop_after_steps=3)
    stopped = RunRecord.from_json(base / "run" / "record.json")
    shards = sorted(p.name for p in latest_checkpoint(base / "run").glob("*.distcp"))
    launch(base / "plan.json", base / "run", data, "cpu", resume=True)
    return plan, base / "full", stopped, shards, base / "run"


@pytest.mark.slow
def test_two_process_fsdp2_run_resumes_to_the_same_loss(two_process):
    """Sharded model and optimizer state through torch.distributed.checkpoint, each rank its
    own shard; the resumed run reaches the uninterrupted run's losses."""
    _, full_dir, stopped, shards, run_dir = two_process
    assert (stopped.stop_reason, stopped.steps) == ("interrupted", 3)
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    full = RunRecord.from_json(full_dir / "record.json")
    resumed = RunRecord.from_json(run_dir / "record.json")
    assert resumed.stop_reason == "budget" and resumed.world_size == 2
    assert [s for s, _ in resumed.train_loss] == list(range(8))
    bad = [(s, a, b) for (s, a), (_, b) in zip(resumed.train_loss, full.train_loss, strict=False) if not _close(a, b)]
    assert not bad, f"(step, resumed, uninterrupted) train losses differ: {bad}"
    assert _close(resumed.final_heldout_loss, full.final_heldout_loss), \
        (resumed.final_heldout_loss, full.final_heldout_loss)


@pytest.mark.slow
def test_two_process_run_through_the_cli(two_process):
    """sp_degree 2 x zero_stage 2 on two gloo processes, launched by `trainplan run`: the
    record of both ranks, the report files and the plan copied into the run folder."""
    _, out, _, _, _ = two_process
    record = RunRecord.from_json(out / "record.json")
    assert record.world_size == 2, record.world_size
    assert len(record.per_rank_peak_bytes) == 2 and all(b > 0 for b in record.per_rank_peak_bytes), \
        record.per_rank_peak_bytes
    assert record.steps == 8 and record.stop_reason == "budget", (record.steps, record.stop_reason)
    assert all(math.isfinite(loss) for _, loss in record.train_loss), record.train_loss
    assert (out / "report.png").exists() and (out / "comparison.csv").exists()
    assert json.loads((out / "plan.json").read_text())["decisions"]["sp_degree"] == 2


@pytest.mark.slow
def test_two_process_accumulation_trains_the_one_process_batch(two_process, corpus, cpu_profile, tmp_path,
                                                                one_thread):
    """FSDP2 reduce-scatters the sharded gradient at every micro-step and the optimizer steps
    after the second (`trainplan.executor.accumulation`): the two-process run reaches the held-out loss
    of one process accumulating the same two micro-batches (fp32; SP splits each sequence, so
    both runs read the same windows). DDP's deferred all-reduce (`no_sync`) is
    tests/integration/test_grad_accum_parallel.py's."""
    _, full_dir, _, _, _ = two_process
    one = plan_for_choice("tiny-llama", cpu_profile, seq_len=64, micro_batch=1, grad_accum=2,
                          max_steps=8, vocab_size=corpus.vocab_size, data_tokens=corpus.n_train_tokens,
                          optimizer_bits=32)
    ref = run(one, data=corpus, out=tmp_path / "one", device="cpu", progress=False, checkpoint_every=0,
              check_fits=False)
    full = RunRecord.from_json(full_dir / "record.json")
    assert full.tokens == ref.tokens == 8 * 2 * 64, (full.tokens, ref.tokens)
    assert math.isclose(full.final_heldout_loss, ref.final_heldout_loss, rel_tol=1e-5), \
        (full.final_heldout_loss, ref.final_heldout_loss)


@pytest.mark.slow
def test_two_process_fsdp2_checkpoint_exports_to_transformers(two_process, corpus_path, tmp_path):
    """`trainplan export-weights` on the FSDP2 run (each rank's shards of every parameter), in one
    process without a process group: transformers loads the folder and its held-out loss is the
    run's final one (the run evaluated under SP 2, split over both ranks)."""
    from tests.support import transformers_heldout_loss
    from trainplan.executor.weights.export import export_weights

    plan, full_dir, _, _, _ = two_process
    out = export_weights(full_dir, tmp_path / "hf")
    data = load_corpus([corpus_path], vocab_size=plan.vocab_size)  # the run's own (`trainplan run --data`)
    full = RunRecord.from_json(full_dir / "record.json")
    assert math.isclose(transformers_heldout_loss(out, plan, data), full.final_heldout_loss, rel_tol=1e-5), \
        full.final_heldout_loss
