"""Tests for trainplan.executor.parallel.ulysses (Ulysses SP, ZeRO stages) and trainplan.executor.parallel.launch
(torchrun, faults).

Multi-process cases run tests/integration/_parallel_worker.py under torchrun (gloo, CPU) through
`run_torchrun`, write results to tmp_path, and are compared here with single-process references
on the same tiny fp32 Llama (4 heads, 2 kv heads, seq 16, global batch 4).
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import torch

import trainplan.executor.parallel.launch as launch
from trainplan.errors import TrainplanError
from trainplan.executor.parallel.launch import WorkerFailedError, run_torchrun
from trainplan.executor.parallel.ulysses import (
    ULYSSES,
    check_sp_degree,
    enable_ulysses,
    new_sequence_parallel_group,
    shard_sequence,
    sp_loss,
    valid_sp_degrees,
)  # fmt: skip
from trainplan.executor.parallel.zero import apply_zero

_spec = importlib.util.spec_from_file_location(
    "_parallel_worker", Path(__file__).with_name("_parallel_worker.py")
)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

WORKER = "tests.integration._parallel_worker"
LAUNCH_TIMEOUT_S = 300  # a hang guard: several modes per launch, on loaded cores
RTOL, ATOL = 1e-5, 1e-7


def _launch(out: Path, nproc: int, *args: str) -> Path:
    mode, *rest = args
    run_torchrun(
        WORKER, [mode, str(out), *rest], nproc, timeout_s=LAUNCH_TIMEOUT_S, log_dir=out / "logs"
    )
    return out


# --------------------------------------------------------------------------------------------
# single-process references
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_grads() -> tuple[float, dict[str, torch.Tensor]]:
    """Plain HF forward/backward (sdpa, HF's own shifted mean CE) on the whole global batch."""
    model = worker.build_model()
    ids, labels = worker.global_batch()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def reference_losses() -> list[float]:
    """Losses before step 1, before step 2 and after step 2, single process, whole batch."""
    model = worker.build_model()
    opt = worker.optimizer_factory(model.parameters())
    ids, labels = worker.global_batch()
    losses = []
    for step in range(3):
        loss = model(input_ids=ids, labels=labels).loss
        losses.append(loss.item())
        if step < 2:
            loss.backward()
            opt.step()
            opt.zero_grad()
    return losses


# --------------------------------------------------------------------------------------------
# multi-process runs (one torchrun launch each, shared by the tests below)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> Path:
    """The 2-process sp, zero and mem cases, in one launch (the worker's ``several`` mode)."""
    mem = [f"{sp}:{stage}" for sp, stage in MEM_CASES] + [f"{sp}:{stage}:bf16-mixed" for sp, stage in MP_CASES]
    return _launch(tmp_path_factory.mktemp("world2"), 2, "several", "sp", "2:0", "2:3",
                   "+", "zero", "0", "1", "2", "3", "+", "mem", *mem)


@pytest.fixture(scope="module")
def sp_world2(world2) -> Path:
    return world2


@pytest.fixture(scope="module")
def sp_world4(tmp_path_factory) -> Path:
    # SP 4 with 2 kv heads replicates kv heads; 2:0 on 4 ranks is dp 2 x sp 2.
    return _launch(tmp_path_factory.mktemp("sp_world4"), 4, "sp", "4:0", "2:0", "4:2")


@pytest.fixture(scope="module")
def zero_world2(world2) -> Path:
    return world2


@pytest.mark.parametrize(
    ("run", "sp", "world", "stage"),
    [
        ("sp_world2", 2, 2, 0),
        ("sp_world2", 2, 2, 3),
        ("sp_world4", 4, 4, 0),
        ("sp_world4", 2, 4, 0),
        ("sp_world4", 4, 4, 2),
    ],
    ids=["sp2-ddp", "sp2-fsdp3", "sp4-ddp", "dp2xsp2-ddp", "sp4-fsdp2"],
)
def test_sp_loss_and_grads_match_single_process(request, reference_grads, run, sp, world, stage):
    ref_loss, ref_grads = reference_grads
    got = torch.load(request.getfixturevalue(run) / f"sp{sp}_world{world}_stage{stage}.pt")
    torch.testing.assert_close(
        torch.tensor(got["loss"]), torch.tensor(ref_loss), rtol=RTOL, atol=ATOL
    )
    assert got["grads"].keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        torch.testing.assert_close(
            got["grads"][name], ref, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_collectives_return_after_gloo_released_the_buffers(sp_world2):
    """`trainplan.executor.parallel.collectives` returns only once gloo's worker thread has dropped its references,
    so the caller frees the buffers (module docstring there): use count 1 right after return."""
    for rank in range(2):
        counts = torch.load(sp_world2 / f"release_rank{rank}.pt")
        assert counts and all(c == [1] * len(c) for c in counts.values()), (rank, counts)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_matches_single_process_after_two_steps(zero_world2, reference_losses, stage):
    got = torch.load(zero_world2 / f"zero_stage{stage}.pt")
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(reference_losses), rtol=RTOL, atol=ATOL
    )
    # AdamW's exp_avg on rank 0: the full model for stage 0, about half of it when sharded.
    if stage == 0:
        assert got["state_numel"] == got["param_numel"]
    else:
        assert got["state_numel"] <= 0.6 * got["param_numel"], got


MEM_CASES = [(1, 0), (1, 1), (2, 2), (2, 3), (1, 3)]
"""(sp_degree, zero_stage) on 2 processes: DDP, DDP + ZeroRedundancyOptimizer, FSDP2."""
MEM_RTOL = 0.005
DDP_EXTRA_TEMP_RTOL = 0.015
"""DDP cases: MEM_RTOL plus the one unexplained temporary (see the test's docstring)."""
MP_CASES = [(1, 3)]
"""(sp_degree, zero_stage) run bf16-mixed: FSDP2 with MixedPrecisionPolicy(bf16, fp32)."""


@pytest.fixture(scope="module")
def mem_world2(world2) -> Path:
    return world2


@pytest.fixture(scope="module")
def mem_step_model(cpu_profile):
    from trainplan.costmodels.step.model import StepModel
    from trainplan.planner.capture.graph import capture

    model = worker.build_mem_model(device="meta")
    g = capture(model)
    return StepModel(g.regions, g.blocks, tuple(p.numel() for p in model.parameters()), cpu_profile,
                     n_heads=g.n_heads, n_kv_heads=g.n_kv_heads, head_dim=g.head_dim)


@pytest.mark.parametrize(("sp", "stage"), MEM_CASES, ids=[f"sp{sp}-zero{z}" for sp, z in MEM_CASES])
def test_predicted_peak_per_rank_matches_memtracker(mem_world2, mem_step_model, sp, stage):
    """Each rank's MemTracker peak over the executor's step within MEM_RTOL of the prediction,
    and the same on both ranks. ZeRO-3: FSDP2's root group (embedding, final norm, LM head: 8
    of 13.6 MiB here) all-gathered in forward and again for backward, its gradients whole until
    the end of the backward (was 17% under with 2 ranks, 36% with 4); ZeRO-1: the local
    optimizer's states (were not tracked); SP 2: o_proj's input, an all-to-all result each block
    keeps (`trainplan.costmodels.step.ulysses`; was 1-2% under). Equal ranks: FSDP2's all-gather buffers freed
    where FSDP2 drops them (`trainplan.executor.parallel.collectives`; one rank of a loaded run used to hold one
    block's gathered parameters more).

    What timing still decides, under FSDP2 (ZeRO 2/3) only: `trainplan.executor.parallel.collectives`
    waits at most `RELEASE_TIMEOUT_S` for gloo's worker thread to let go of an all-gather
    buffer; a thread starved that long on a loaded machine frees it late, and that rank's peak
    then holds the next block's prefetched gathered parameters beside it: exactly one block's
    gathered parameter bytes more (`StepModel.fsdp_layout`; with the wait disabled, one rank
    of sp1-zero3 measured 51.02 + 2.77 MiB). So a rank may measure the prediction or the
    prediction plus one block's gathered parameters, each within MEM_RTOL, and the ranks may
    differ by that block; a peak anywhere else is a modelling error.

    DDP (ZeRO 0/1): with fused AdamW (no step temporaries) the peak is in the last block's
    backward, with DDP's gradient buckets. MemTracker measures one (256 x 688) fp32 temporary
    more there than the model (1.0% of the peak: three of the SwiGLU backward's tensors alive
    where the region replay has two; not yet explained), so these cases allow
    DDP_EXTRA_TEMP_RTOL instead of MEM_RTOL."""
    from trainplan.costmodels.step.model import Choice

    got = torch.load(mem_world2 / f"mem_sp{sp}_stage{stage}.pt")
    c = Choice(sp_degree=sp, zero_stage=stage, micro_batch=1, seq_len=worker.MEM_SEQ_LEN,
               policies=("none",) * len(mem_step_model.blocks), precision="fp32",
               optimizer_bits=32, devices=2)
    pred = mem_step_model.evaluate(c).memory
    layout = mem_step_model.fsdp_layout(c)
    late = () if layout is None else (max(layout.block_param_bytes),)  # a late-freed block's buffer
    per_rank = got["per_rank"]
    rtol = MEM_RTOL if stage >= 2 else DDP_EXTRA_TEMP_RTOL
    for rank, meas in enumerate(per_rank):
        err = pred.total - meas
        assert any(abs(err + extra) <= rtol * meas for extra in (0.0, *late)), (
            f"rank {rank}: predicted {pred.total / 2**20:.2f} MiB at {pred.phase}, MemTracker "
            f"{meas / 2**20:.2f} MiB ({err / meas:+.2%}; a late-freed block would be "
            f"{[x / 2**20 for x in late]} MiB); predicted {pred.as_dict()}, rank 0 measured {got['rank0']}")
    if stage != 1:  # ZeroRedundancyOptimizer gives ranks whole tensors, unequal shares
        diff = max(per_rank) - min(per_rank)
        assert diff == 0 or any(abs(diff - x) <= MEM_RTOL * max(per_rank) for x in late), \
            f"ranks differ: {per_rank}"
    if stage == 1:  # the local optimizer's states are counted
        assert got["rank0"]["optimizer"] > 0


@pytest.fixture(scope="module")
def mp_step_model(cpu_profile):
    """The memory model's Llama captured as bf16-mixed: autocast regions (DDP) and the `@mp`
    ones FSDP2's mixed-precision policy runs (`trainplan.planner.capture.setup.capture_model`)."""
    from trainplan.costmodels.step.model import StepModel
    from trainplan.planner.capture.setup import capture_model

    model = worker.build_mem_model(device="meta")
    g, _, numels = capture_model(model, "bf16-mixed")
    return StepModel(g.regions, g.blocks, numels, cpu_profile, n_heads=g.n_heads,
                     n_kv_heads=g.n_kv_heads, head_dim=g.head_dim)


@pytest.mark.parametrize(("sp", "stage"), MP_CASES, ids=[f"sp{sp}-zero{z}" for sp, z in MP_CASES])
def test_mixed_precision_policy_peak_matches_memtracker(mem_world2, mp_step_model, sp, stage):
    """bf16-mixed under FSDP2 (`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, no
    autocast): bf16 all-gathered parameters and activations, fp32 gradient shards and
    reduce-scatter buffers, fp32 sharded parameters and Adam states. Each rank's MemTracker peak
    within MEM_RTOL of the prediction (or of it plus one late-freed block, as
    `test_predicted_peak_per_rank_matches_memtracker` explains); and the prediction is well
    under the fp32 run's, so that a model that ignored the policy would fail."""
    from trainplan.costmodels.step.model import Choice

    got = torch.load(mem_world2 / worker.mem_file(sp, stage, "bf16-mixed"))
    c = Choice(sp_degree=sp, zero_stage=stage, micro_batch=1, seq_len=worker.MEM_SEQ_LEN,
               policies=("none",) * len(mp_step_model.blocks), precision="bf16-mixed",
               optimizer_bits=32, devices=2)
    assert mp_step_model.mixed_precision_policy(c)
    pred = mp_step_model.evaluate(c).memory
    late = (max(mp_step_model.fsdp_layout(c).block_param_bytes),)
    for rank, meas in enumerate(got["per_rank"]):
        err = pred.total - meas
        assert any(abs(err + extra) <= MEM_RTOL * meas for extra in (0.0, *late)), (
            f"rank {rank}: predicted {pred.total / 2**20:.2f} MiB at {pred.phase}, MemTracker "
            f"{meas / 2**20:.2f} MiB ({err / meas:+.2%}); predicted {pred.as_dict()}, rank 0 "
            f"measured {got['rank0']}")
    fp32 = torch.load(mem_world2 / worker.mem_file(sp, stage))
    assert max(got["per_rank"]) < 0.9 * max(fp32["per_rank"])


# --------------------------------------------------------------------------------------------
# faults: nothing may hang
# --------------------------------------------------------------------------------------------


def test_failed_worker_names_rank(tmp_path):
    start = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        run_torchrun(WORKER, ["fail", str(tmp_path)], 2, timeout_s=60, log_dir=tmp_path / "logs")
    assert time.monotonic() - start < 60
    err = info.value
    assert err.rank == 1 and err.exit_code == 1
    assert "rank 1" in str(err) and "exit code 1" in str(err)
    assert "injected failure on rank 1" in str(err)  # the tail of rank 1's stderr
    assert isinstance(err, TrainplanError)


def test_timeout_kills_workers_that_ignore_sigterm(tmp_path, monkeypatch):
    """The job's timeout counted from when both workers hang (each has written its pid): on a
    loaded machine torchrun alone can take most of a short timeout to start them."""
    monkeypatch.setattr(launch, "KILL_GRACE_S", 1.0)
    timed: list[float] = []

    class Popen(launch.subprocess.Popen):
        def wait(self, timeout=None):
            if timeout is not None and not timed:  # run_torchrun's wait for the job
                deadline = time.monotonic() + LAUNCH_TIMEOUT_S
                while len(list(tmp_path.glob("pid_*"))) < 2 and self.poll() is None:
                    assert time.monotonic() < deadline, "workers did not start"
                    time.sleep(0.05)
                timed.append(time.monotonic())
            return super().wait(timeout)

    monkeypatch.setattr(launch.subprocess, "Popen", Popen)
    with pytest.raises(WorkerFailedError, match="timed out after 2 s"):
        run_torchrun(WORKER, ["hang", str(tmp_path)], 2, timeout_s=2, log_dir=tmp_path / "logs")
    assert time.monotonic() - timed[0] < 30
    pids = [int(p.read_text()) for p in tmp_path.glob("pid_*")]
    assert len(pids) == 2, "workers did not start within the timeout"
    for pid in pids:  # gone, or a zombie waiting for PID 1 to reap it; a SIGKILLed process
        # still shows R until the kernel schedules its exit (seconds on a loaded machine)
        assert _dies_within(pid, 10.0), f"worker {pid} still running 10 s after the launch returned"


def _dies_within(pid: int, seconds: float) -> bool:
    """Whether process `pid` is gone or a zombie (/proc state Z or X) within `seconds`."""
    stat, deadline = Path(f"/proc/{pid}/stat"), time.monotonic() + seconds
    while True:
        try:
            state = stat.read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


# --------------------------------------------------------------------------------------------
# single-process: divisibility errors, sharding, the attention function without a group
# --------------------------------------------------------------------------------------------


def test_sp_degree_must_divide_seq_len_and_heads():
    check_sp_degree(4, seq_len=16, num_heads=4)
    both = r"sp_degree 3 does not divide seq_len 16 and attention heads 4"
    with pytest.raises(TrainplanError, match=both) as info:
        check_sp_degree(3, seq_len=16, num_heads=4)
    assert "[1, 2, 4]" in str(info.value)
    heads = r"attention heads 4; valid sp degrees for seq_len 64 and attention heads 4: \[1, 2, 4\]"
    with pytest.raises(TrainplanError, match=heads):
        check_sp_degree(8, seq_len=64, num_heads=4)
    with pytest.raises(TrainplanError, match="positive integer"):
        check_sp_degree(0)
    assert valid_sp_degrees(seq_len=12, num_heads=8) == [1, 2, 4]


def test_shard_sequence_rejects_indivisible_seq_len():
    ids = torch.zeros(2, 10, dtype=torch.long)
    seq = r"sp_degree 4 does not divide seq_len 10.*\[1, 2, 5, 10\]"
    with pytest.raises(TrainplanError, match=seq):
        shard_sequence(ids, ids, 0, 4)


def test_sp_without_process_group_is_an_error():
    with pytest.raises(TrainplanError, match="needs 2 processes"):
        new_sequence_parallel_group(2)
    assert new_sequence_parallel_group(1) is None


def test_shards_concatenate_to_shifted_labels_and_global_positions():
    ids, labels = worker.global_batch()
    shards = [shard_sequence(ids, labels, r, 4) for r in range(4)]
    assert all(s[0].shape == (4, 4) for s in shards)
    torch.testing.assert_close(torch.cat([s[0] for s in shards], 1), ids)
    shifted = torch.cat([labels[:, 1:], torch.full((4, 1), -100)], 1)
    torch.testing.assert_close(torch.cat([s[1] for s in shards], 1), shifted)
    torch.testing.assert_close(torch.cat([s[2] for s in shards], 1), torch.arange(16).expand(4, -1))


def test_ulysses_without_group_equals_sdpa_and_sp_loss_equals_hf_loss():
    model = worker.build_model()
    ids, labels = worker.global_batch()
    ref = model(input_ids=ids, labels=labels)
    enable_ulysses(model, seq_len=16)  # SP degree 1: a no-op
    assert model.config._attn_implementation == "sdpa"
    model.set_attn_implementation(ULYSSES)
    ids_s, tgt_s, pos_s = shard_sequence(ids, labels, 0, 1)
    logits = model(input_ids=ids_s, position_ids=pos_s, use_cache=False).logits
    torch.testing.assert_close(logits, ref.logits, rtol=RTOL, atol=1e-6)
    torch.testing.assert_close(sp_loss(logits, tgt_s, None, None), ref.loss, rtol=RTOL, atol=ATOL)


def test_apply_zero_world_one_returns_model_unchanged():
    model = worker.build_model()
    out, opt = apply_zero(model, worker.optimizer_factory, stage=3, device=torch.device("cpu"))
    assert out is model and isinstance(opt, torch.optim.AdamW)
    with pytest.raises(TrainplanError, match="zero stage must be 0, 1, 2 or 3"):
        apply_zero(model, worker.optimizer_factory, stage=4, device=torch.device("cpu"))


def test_first_cause_skips_a_rank_that_only_lost_its_peer(tmp_path):
    """Ranks failing in the same second are listed by torchrun in polling order: the rank whose
    collective only lost its peer is not the cause when another failed rank is not like that."""
    from trainplan.executor.parallel.launch import first_cause

    run = tmp_path / "run"
    for r, text in ((0, "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer"),
                    (1, "RuntimeError: injected failure on rank 1")):
        (run / "attempt_0" / str(r)).mkdir(parents=True)
        (run / "attempt_0" / str(r) / "stderr.log").write_text(f"[rank{r}]: {text}\n")
    failure = "  rank      : {r} (local_rank: {r})\n  exitcode  : 1 (pid: 1)\n"
    summary = ("Failures:\n[1]:\n" + failure.format(r=1)
               + "Root Cause (first observed failure):\n[0]:\n" + failure.format(r=0))
    assert first_cause(summary, [run]) == (1, 1, 1)
    (run / "attempt_0" / "1" / "stderr.log").write_text("Connection closed by peer\n")
    assert first_cause(summary, [run]) == (0, 0, 1)  # both lost a peer: torchrun's root cause
    assert first_cause("no summary", [run]) is None
