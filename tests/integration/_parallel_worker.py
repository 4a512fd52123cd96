"""Worker for tests/integration/test_parallel.py under torchrun:
``python -m tests.integration._parallel_worker MODE OUT``.

Modes:
- ``sp OUT SP:STAGE...``: per case one forward/backward of the tiny Llama with Ulysses SP of degree
  SP (dp = world / SP) under ZeRO stage STAGE; rank 0 saves loss and full gradients; every rank
  saves `release_counts` (``trainplan.executor.parallel.collectives`` leaves no reference with gloo).
- ``zero OUT STAGE...``: pure data parallel, 2 optimizer steps per stage; rank 0 saves the 3 losses.
- ``mem OUT SP:STAGE...``: per case the executor's own step (``trainplan.executor.train``'s loss,
  optimizer and held-out evaluation after each step) on a larger Llama (`mem_config`); the third
  step under MemTracker (``trainplan.executor.measure.measure_memory``); rank 0 saves every rank's peak.
- ``fail OUT``: rank 1 raises, rank 0 waits in a barrier (torchrun must stop it).
- ``hang OUT``: every rank ignores SIGTERM, writes its pid and sleeps (run_torchrun must kill it).
- ``several OUT MODE ARGS... + MODE ARGS...``: the ``sp``, ``zero`` and ``mem`` modes one after
  another in one launch and one process group (`run_several`).

Imports only torch, transformers and executor (``mem`` mode: also trainplan.executor.train/measure); the
heavy ones lazily, so the fault modes start fast. The model/data builders are also used by the test for the references.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

SEQ_LEN = 16
GLOBAL_BATCH = 4
SEED = 0


def tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )


def build_model():
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(SEED)
    return LlamaForCausalLM(tiny_config()).float().train()


MEM_SEQ_LEN = 256


def mem_config():
    """A Llama whose states and activations are MiBs (root group 8 MiB, 2 blocks of 2.8 MiB), so
    that the few-hundred-byte leftovers the memory model ignores stay far below 1%."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=4096,
        max_position_embeddings=MEM_SEQ_LEN,
        attn_implementation="sdpa",
        use_cache=False,
    )


def build_mem_model(device: str = "cpu"):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(SEED)
    with torch.device(device):
        return LlamaForCausalLM(mem_config()).float().train()


def global_batch(seed: int = 1):
    """(GLOBAL_BATCH, SEQ_LEN) token ids and HF-convention labels, a few of them ignored (-100)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, tiny_config().vocab_size, (GLOBAL_BATCH, SEQ_LEN), generator=g)
    labels = ids.clone()
    labels[0, 5:9] = -100  # uneven token counts across shards and replicas
    labels[3, 12:] = -100
    return ids, labels


def optimizer_factory(params):
    import torch

    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _inner(model):
    return getattr(model, "module", model)  # DDP wraps, FSDP2 does not


def _replica_rows(rank: int, world: int, sp: int):
    dp = world // sp
    per = GLOBAL_BATCH // dp
    lo = (rank // sp) * per
    return slice(lo, lo + per)


def run_sp(out: Path, cases: list[tuple[int, int]]) -> None:
    """One forward/backward per (sp_degree, zero_stage) case; dp = world / sp_degree."""
    import torch
    import torch.distributed as dist

    from trainplan.executor.parallel.launch import init_distributed
    from trainplan.executor.parallel.ulysses import (
        enable_ulysses,
        new_sequence_parallel_group,
        shard_sequence,
        sp_loss,
    )  # fmt: skip
    from trainplan.executor.parallel.zero import apply_zero

    device = torch.device("cpu")
    rank, world = init_distributed(device, timeout_s=60)
    ids, labels = global_batch()
    for sp, stage in cases:
        new_sequence_parallel_group(sp)
        rows = _replica_rows(rank, world, sp)
        ids_s, tgt_s, pos_s = shard_sequence(ids[rows], labels[rows], rank % sp, sp)
        model = build_model()
        enable_ulysses(model, seq_len=SEQ_LEN)
        model, _ = apply_zero(model, optimizer_factory, stage=stage, device=device)
        logits = model(input_ids=ids_s, position_ids=pos_s, use_cache=False).logits
        loss = sp_loss(logits, tgt_s, None, None)
        loss.backward()
        grads = {n: _full(p.grad).detach().clone() for n, p in _inner(model).named_parameters()}
        if rank == 0:
            name = f"sp{sp}_world{world}_stage{stage}.pt"
            torch.save({"loss": loss.item(), "grads": grads}, out / name)
    torch.save(release_counts(), out / f"release_rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def release_counts(n: int = 20) -> dict[str, list[int]]:
    """TensorImpl use counts of the tensors `trainplan.executor.parallel.collectives`' all-to-all, all-gather and
    reduce-scatter were given, right after each returns (1: only this frame holds them; the
    gloo work object has let go)."""
    import torch
    import torch.distributed as dist

    from trainplan.executor.parallel import collectives

    world = dist.get_world_size()
    counts: dict[str, list[int]] = {"all_to_all": [], "all_gather": [], "reduce_scatter": []}
    for _ in range(n):
        x, out = torch.randn(world * 64), torch.empty(world * 64)
        collectives.all_to_all_single(out, x, None)
        counts["all_to_all"].append(max(x._use_count(), out._use_count()))
        x, out = torch.randn(64), torch.empty(world * 64)
        collectives.ReleasingAllGather()(out, x, dist.group.WORLD)
        counts["all_gather"].append(max(x._use_count(), out._use_count()))
        x, out = torch.randn(world * 64), torch.empty(64)
        collectives.ReleasingReduceScatter()(out, x, dist.group.WORLD, dist.ReduceOp.SUM)
        counts["reduce_scatter"].append(max(x._use_count(), out._use_count()))
    return counts


def run_zero(out: Path, stages: list[int], steps: int = 2) -> None:
    import torch
    import torch.distributed as dist

    from trainplan.executor.parallel.launch import init_distributed
    from trainplan.executor.parallel.ulysses import shard_sequence, sp_loss
    from trainplan.executor.parallel.zero import apply_zero

    device = torch.device("cpu")
    rank, world = init_distributed(device, timeout_s=60)
    rows = _replica_rows(rank, world, 1)
    ids, labels = global_batch()
    ids_r, tgt_r, pos_r = shard_sequence(ids[rows], labels[rows], 0, 1)
    for stage in stages:
        model, opt = apply_zero(build_model(), optimizer_factory, stage=stage, device=device)
        losses = []
        for step in range(steps + 1):  # the last forward measures the loss after `steps` steps
            logits = model(input_ids=ids_r, position_ids=pos_r, use_cache=False).logits
            loss = sp_loss(logits, tgt_r, None, None)
            losses.append(loss.item())
            if step < steps:
                loss.backward()
                opt.step()
                opt.zero_grad()
        state = opt.optim.state if hasattr(opt, "optim") else opt.state  # ZeRO-1: local optim
        state_numel = sum(_local(st["exp_avg"]).numel() for st in state.values())
        param_numel = sum(p.numel() for p in _inner(model).parameters())  # DTensor: global numel
        if rank == 0:
            result = {"losses": losses, "state_numel": state_numel, "param_numel": param_numel}
            torch.save(result, out / f"zero_stage{stage}.pt")
    dist.barrier()
    dist.destroy_process_group()


def mem_case(text: str) -> tuple[int, int, str]:
    """``SP:STAGE[:PRECISION]`` -> (sp_degree, zero_stage, precision); precision fp32 when not
    given, or bf16-mixed (FSDP2's MixedPrecisionPolicy at ZeRO 2/3, as `trainplan.executor.train` runs it)."""
    sp, stage, *rest = text.split(":")
    return int(sp), int(stage), (rest[0] if rest else "fp32")


def mem_file(sp: int, stage: int, precision: str = "fp32") -> str:
    suffix = "" if precision == "fp32" else f"_{precision}"
    return f"mem_sp{sp}_stage{stage}{suffix}.pt"


def run_mem(out: Path, cases: list[tuple[int, int, str]]) -> None:
    """Per (sp_degree, zero_stage, precision): two steps each followed by a held-out evaluation,
    as `trainplan.executor.train.run` does, then one step under MemTracker; rank 0 saves all ranks' peaks."""
    from functools import partial

    import torch
    import torch.distributed as dist

    from trainplan.executor.apply.applied import micro_batch_loss
    from trainplan.executor.measure import gather_floats, heldout_loss, measure_memory
    from trainplan.executor.optimizers import build_optimizer
    from trainplan.executor.parallel.launch import init_distributed
    from trainplan.executor.parallel.ulysses import enable_ulysses, new_sequence_parallel_group
    from trainplan.executor.parallel.zero import apply_zero, mixed_precision_policy

    torch.set_num_threads(1)
    device = torch.device("cpu")
    rank, world = init_distributed(device, timeout_s=60)
    vocab = mem_config().vocab_size
    for sp, stage, precision in cases:
        new_sequence_parallel_group(sp)
        model = build_mem_model()
        enable_ulysses(model, seq_len=MEM_SEQ_LEN)
        decisions = SimpleNamespace(precision=precision, zero_stage=stage, devices=world)
        model, opt = apply_zero(model, partial(build_optimizer, bits=32, lr=1e-3), stage=stage,
                                device=device, mp_policy=mixed_precision_policy(decisions))
        forward_loss = partial(micro_batch_loss, model, device, sp, rank % sp, world)

        def batch(i: int, sp: int = sp):
            g = torch.Generator().manual_seed(1000 * i + rank // sp)
            ids = torch.randint(0, vocab, (1, MEM_SEQ_LEN + 1), generator=g)
            return ids[:, :-1], ids[:, 1:]

        def step(i: int, forward_loss=forward_loss, opt=opt) -> None:
            loss = forward_loss(*batch(i))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for i in range(2):
            step(i)
            heldout_loss(model, [batch(99)], forward_loss)
        peak = measure_memory(lambda: step(2), model, opt)
        totals = gather_floats(peak["total"], world)
        if rank == 0:
            torch.save({"per_rank": totals, "rank0": peak}, out / mem_file(sp, stage, precision))
    dist.barrier()
    dist.destroy_process_group()


def run_fail(out: Path) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    # torch alone (the executor package imports transformers and more): a fault mode starts fast
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    if rank == 1:
        print("rank 1 about to fail", file=sys.stderr, flush=True)
        raise RuntimeError("injected failure on rank 1")
    dist.barrier()  # never completes: rank 1 is gone; torchrun must stop this rank


def run_hang(out: Path) -> None:
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL stops it
    (out / f"pid_{os.environ['RANK']}").write_text(str(os.getpid()))
    while True:
        time.sleep(1)


def run_several(out: Path, groups: list[list[str]]) -> None:
    """Each ``[MODE, ARGS...]`` of `groups` in turn, in this launch: process start-up (torch and
    transformers imported by every rank) is most of a short launch's time. One process group for
    all: each mode's ``destroy_process_group`` is deferred to the end, because a group created
    again reuses the first one's subgroup names, whose addresses torchrun's store still holds
    (gloo then connects to a closed port)."""
    import torch.distributed as dist

    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *args, **kwargs: None
    try:
        for mode, *args in groups:
            if mode not in ("sp", "zero", "mem"):
                raise SystemExit(f"mode {mode!r} cannot run with others")
            run_mode(mode, out, args)
    finally:
        dist.destroy_process_group = destroy
    if dist.is_initialized():
        destroy()


def run_mode(mode: str, out_path: Path, rest: list[str]) -> None:
    if mode == "sp":
        run_sp(out_path, [tuple(int(x) for x in case.split(":")) for case in rest])
    elif mode == "zero":
        run_zero(out_path, [int(s) for s in rest])
    elif mode == "mem":
        run_mem(out_path, [mem_case(case) for case in rest])
    elif mode == "fail":
        run_fail(out_path)
    elif mode == "hang":
        run_hang(out_path)
    elif mode == "several":
        groups: list[list[str]] = [[]]
        for arg in rest:
            if arg == "+":
                groups.append([])
            else:
                groups[-1].append(arg)
        run_several(out_path, groups)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    mode, out_dir, *rest = sys.argv[1:]
    run_mode(mode, Path(out_dir), rest)
