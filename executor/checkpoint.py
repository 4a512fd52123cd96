"""Checkpoints of a run and the typed outcomes of a run that stops early.

Layout under the run directory::

    RUN_DIR/checkpoint/latest           name of the newest complete checkpoint, e.g. "step-000005"
    RUN_DIR/checkpoint/step-000005/     .metadata + __R_0.distcp ...: model and optimizer state
                                        (torch.distributed.checkpoint, each rank its own shards)
                                        rank0.pt, rank1.pt ...: each rank's torch RNG states
                                        optimizer.pt: ZeRO-1 only (see below)
                                        trainplan.json: steps done, tokens, plan, corpus, the
                                        RunRecord so far
                                        tokenizer.json: a copy of the run's tokenizer, when its
                                        corpus names one (`trainplan.executor.weights.export` writes it out)

Atomic: a checkpoint is written into `step-N.tmp`, renamed to `step-N`, and only then is
`latest` replaced (temporary file + `os.replace`); older step directories are removed last. A
kill at any moment leaves `latest` naming a complete checkpoint.

Model and optimizer state go through `torch.distributed.checkpoint.state_dict.get_state_dict`
/ `set_state_dict`, which handle plain modules, DDP and FSDP2 (sharded DTensor state, each rank
writes and reads its own shards) and optimizers keyed by parameter name, without a process
group for one process. bitsandbytes' 8-bit AdamW state (uint8 `state1`/`state2`, `absmax`,
`qmap`) round-trips through it unchanged. `ZeroRedundancyOptimizer` (ZeRO stage 1) is not
supported by `get_state_dict`: its state is consolidated on rank 0 and saved with `torch.save`
(`optimizer.pt`); every rank loads it and keeps its own partition.

`torch.distributed.checkpoint` (about a second to import) and ZeRO-1's optimizer class are imported
by the functions that save and load, so that reading `CHECKPOINT_DIR` or a plan check
(`check_resume_plan`) does not load them.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import shutil
import warnings
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from trainplan.errors import PlanMismatchError, TrainplanError
from trainplan.executor.record import RunRecord
from trainplan.planner.plan import Plan

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoint"
LATEST = "latest"
META = "trainplan.json"
TOKENIZER = "tokenizer.json"
CHECKPOINT_FORMAT = 1
PLAN_FIELDS_THAT_TRAIN = ("model", "model_n_params", "model_n_layers", "hw", "vocab_size",
                          "decisions")
"""The parts of a plan that decide what is trained; a resumed run must agree on all of them
(predictions, solver facts and the creation time may differ)."""


class OutOfMemoryRunError(TrainplanError):
    """A training step ran out of device (or host) memory; the record so far is written."""


def is_out_of_memory(exc: BaseException) -> bool:
    """True for CUDA/ROCm `torch.OutOfMemoryError` and the CPU allocator's RuntimeError
    ("DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes")."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    msg = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in msg
                                              or "out of memory" in msg.lower())


def out_of_memory_message(plan: Plan, step: int, dev: torch.device, exc: BaseException,
                          out: Path) -> str:
    """One line for an `OutOfMemoryRunError`: the step, the allocator's words, the plan's
    predicted peak against its limit, where the record is and what to change."""
    p, d = plan.predictions, plan.decisions
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    return (f"out of memory in step {step} on {dev} ({first}); the plan predicted a peak of "
            f"{_bytes(p.memory_bytes.get('total', 0.0))} per device (usable "
            f"{_bytes(p.memory_limit_bytes)}); record kept in {out / 'record.json'}; use a "
            f"smaller micro-batch (now {d.micro_batch}) or more activation checkpointing (re-solve "
            f"with `trainplan solve` if the device has less free memory than its profile says)")


def _bytes(n: float) -> str:
    return f"{n / 2**30:.3g} GiB" if n >= 2**30 else f"{n / 2**20:.3g} MiB"


# ------------------------------------------------------------------------------- the plan


def plan_differences(saved: Plan, given: Plan) -> list[str]:
    """`field: saved -> given` for each of `PLAN_FIELDS_THAT_TRAIN` (decisions field by field)
    that differs; empty when the plans train the same thing."""
    a, b = asdict(saved), asdict(given)
    diffs = []
    for key in PLAN_FIELDS_THAT_TRAIN:
        if isinstance(a[key], dict):
            diffs += [f"{key}.{k}: {a[key].get(k)!r} -> {b[key].get(k)!r}"
                      for k in sorted(set(a[key]) | set(b[key])) if a[key].get(k) != b[key].get(k)]
        elif a[key] != b[key]:
            diffs.append(f"{key}: {a[key]!r} -> {b[key]!r}")
    return diffs


def check_resume_plan(plan: Plan, out: str | Path) -> None:
    """Check that `plan` is the plan the run in `out` was started with (`out/plan.json`).

    Raises:
        TrainplanError: `out` holds no plan.json or no checkpoint (nothing to resume).
        PlanMismatchError: the plans differ in what they train; the message names each field
            with the saved and the given value.
    """
    out = Path(out)
    path = out / "plan.json"
    if not path.exists():
        raise TrainplanError(f"cannot resume: {path} does not exist (was {out} a trainplan run "
                             "directory?); start the run without --resume")
    if latest_checkpoint(out) is None:
        raise TrainplanError(f"cannot resume: no checkpoint in {out / CHECKPOINT_DIR}; start the "
                             "run again without --resume")
    diffs = plan_differences(Plan.from_json(path), plan)
    if diffs:
        raise PlanMismatchError(f"cannot resume {out} with a different plan ({path} -> given): "
                                f"{'; '.join(diffs)}; resume with the saved plan (omit PLAN) or "
                                "start a new run directory")


# ------------------------------------------------------------------------------- paths


def latest_checkpoint(out: str | Path) -> Path | None:
    """The newest complete checkpoint directory of the run in `out`, or None."""
    root = Path(out) / CHECKPOINT_DIR
    try:
        name = (root / LATEST).read_text().strip()
    except OSError:
        return None
    path = root / name
    return path if (path / META).exists() else None


def remove_checkpoints(out: str | Path) -> None:
    """Delete the run's checkpoints (a fresh run in a used directory starts over)."""
    shutil.rmtree(Path(out) / CHECKPOINT_DIR, ignore_errors=True)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def _is_zero1(opt) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(opt, ZeroRedundancyOptimizer)


@contextmanager
def _quiet():
    """DCP warns that it assumes a single process when no process group exists: intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# ------------------------------------------------------------------------------- save / load


def _states(model: nn.Module, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if _is_zero1(opt):
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def _rng_state(dev: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if dev.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(dev)
    return state


def save_checkpoint(out: str | Path, model: nn.Module, opt, *, record: RunRecord, plan: Plan,
                    corpus: dict[str, str], dev: torch.device, rank: int = 0,
                    world: int = 1) -> Path:
    """Write the state after `record.steps` steps to `out/checkpoint/step-N` (atomically, see
    the module docstring) and return that directory. Every rank calls it (collective when
    world > 1). When `step-N` exists already (nothing trained since), only its record is
    rewritten. `record.checkpoint` is set to the returned path before it is saved."""
    import torch.distributed.checkpoint as dcp

    root = Path(out) / CHECKPOINT_DIR
    final = root / f"step-{record.steps:06d}"
    tmp = root / f"{final.name}.tmp"
    record.checkpoint = str(final)
    meta = {"format": CHECKPOINT_FORMAT, "steps": record.steps, "tokens": record.tokens,
            "world_size": world, "plan": json.loads(plan.to_json()), "corpus": corpus,
            "optimizer": "torch.save (ZeroRedundancyOptimizer)" if _is_zero1(opt) else "dcp",
            "torch": torch.__version__, "saved": dt.datetime.now().isoformat(timespec="seconds"),
            "record": asdict(record)}
    if (final / META).exists():  # same step: model and optimizer unchanged, refresh the record
        if rank == 0:
            _write_atomic(final / META, json.dumps(meta, indent=1) + "\n")
            _write_atomic(root / LATEST, final.name + "\n")
        _barrier(world)
        return final
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a write that was killed
        tmp.mkdir(parents=True)
        if corpus.get("tokenizer") and Path(corpus["tokenizer"]).is_file():  # kept with the weights
            shutil.copyfile(corpus["tokenizer"], tmp / TOKENIZER)
    _barrier(world)
    if _is_zero1(opt):
        opt.consolidate_state_dict(to=0)
        if rank == 0:
            torch.save(opt.state_dict(), tmp / "optimizer.pt")
    with _quiet():
        dcp.save(_states(model, opt), checkpoint_id=str(tmp))
    torch.save(_rng_state(dev), tmp / f"rank{rank}.pt")
    _barrier(world)
    if rank == 0:
        (tmp / META).write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(tmp, final)
        _write_atomic(root / LATEST, final.name + "\n")
        for old in root.glob("step-*"):
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
        logger.info("checkpoint after %d steps written to %s", record.steps, final)
    _barrier(world)
    return final


def load_checkpoint(path: str | Path, model: nn.Module, opt, *, corpus: dict[str, str] | None = None,
                    dev: torch.device, rank: int = 0, world: int = 1) -> dict:
    """Restore model, optimizer and this rank's RNG states from checkpoint directory `path`
    (every rank calls it); returns its `trainplan.json` (with `record` a RunRecord).

    Raises:
        PlanMismatchError: the checkpoint was written by a different number of processes, or
            trained on another corpus than `corpus` (name and sha256, when given).
        UnsafeFileError: a pickle in it (optimizer.pt, rankN.pt, DCP's .metadata or an item) names
            a global outside the allow-lists of `trainplan.executor.safe_load`: it is not run.
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    from trainplan.executor.safe_load import dcp_load, load_tensors

    path = Path(path)
    meta = json.loads((path / META).read_text())
    if meta["world_size"] != world:
        raise PlanMismatchError(f"checkpoint {path} was written by {meta['world_size']} "
                                f"process(es); this run has {world}")
    if corpus is not None and meta["corpus"]["sha256"] != corpus["sha256"]:
        raise PlanMismatchError(f"checkpoint {path} was trained on corpus {meta['corpus']['name']!r} "
                                f"(sha256 {meta['corpus']['sha256'][:12]}); this run's corpus is "
                                f"{corpus['name']!r} ({corpus['sha256'][:12]}): pass the same --data")
    states = _states(model, opt)
    with _quiet():
        dcp_load(states, path)  # allow-listed unpickling: a crafted checkpoint is refused, not run
    if _is_zero1(opt):
        set_model_state_dict(model, states["model"])
        # written by save_checkpoint on rank 0: tensors, plain param groups, low-bit optimizer states
        opt.load_state_dict(load_tensors(path / "optimizer.pt", map_location=dev))
    else:
        set_state_dict(model, opt, model_state_dict=states["model"],
                       optim_state_dict=states["optim"])
    rng_path = path / f"rank{rank}.pt"
    if rng_path.exists():
        rng = load_tensors(rng_path)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and dev.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], dev)
    meta["record"] = RunRecord.from_json(json.dumps(meta["record"]))
    logger.info("resuming after %d steps from checkpoint %s", meta["steps"], path)
    return meta
