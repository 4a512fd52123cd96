"""Issue #40 item 17: a run folder's pickles are loaded as data only (`trainplan.executor.safe_load`).

A checkpoint of each optimizer width (fp32 AdamW, bitsandbytes 8-bit, torchao 4-bit) saves and
loads through the allow-lists unchanged; a crafted pickle whose `__reduce__` would create a folder
(`os.makedirs`: what `os.system` would do, harmlessly) is refused as `UnsafeFileError` in
optimizer.pt/rankN.pt (`load_tensors`), DCP's `.metadata` and a DCP non-tensor item, and the file
is not created."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from trainplan.errors import UnsafeFileError
from trainplan.executor.checkpoint import load_checkpoint, save_checkpoint
from trainplan.executor.optimizers import build_optimizer
from trainplan.executor.record import RunRecord
from trainplan.executor.safe_load import dcp_load, load_tensors, read_metadata
from trainplan.planner.api import plan_for_choice

CORPUS = {"name": "words", "sha256": "0" * 64}


class Crafted:
    """A pickle that, when loaded without restriction, calls `os.makedirs(marker)`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (str(self.marker),))


def _trained(bits: int, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 8))  # 65,536 weights: torchao quantizes them
    opt = build_optimizer(model.parameters(), bits, 1e-3)
    for _ in range(2):
        model(torch.randn(4, 256)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.fixture(scope="module")
def plan(cpu_profile):
    return plan_for_choice("tiny-llama", cpu_profile, seq_len=64, micro_batch=1, max_steps=2)


@pytest.mark.parametrize("bits", [32, 8, 4])
def test_a_checkpoint_of_each_optimizer_width_round_trips(bits, plan, tmp_path):
    model, opt = _trained(bits)
    ckpt = save_checkpoint(tmp_path, model, opt, record=RunRecord(model="m", hw_planned="cpu", device="cpu",
                                                                  same_hardware=True, steps=2),
                           plan=plan, corpus=CORPUS, dev=torch.device("cpu"))
    fresh, fresh_opt = _trained(bits, seed=1)
    meta = load_checkpoint(ckpt, fresh, fresh_opt, corpus=CORPUS, dev=torch.device("cpu"))
    assert meta["steps"] == 2
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values(),
                                                   strict=True))
    a, b = opt.state_dict(), fresh_opt.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for sa, sb in zip(a["state"].values(), b["state"].values(), strict=True):
        for key, value in sa.items():
            other = sb[key]
            if isinstance(value, dict):  # bitsandbytes' quantization state
                assert value.keys() == other.keys()
            elif isinstance(value, torch.Tensor):
                assert type(value) is type(other)
                assert torch.equal(value.dequantize() if hasattr(value, "dequantize") else value,
                                   other.dequantize() if hasattr(other, "dequantize") else other)
            else:
                assert value == other


def test_low_bit_optimizer_state_saved_whole_loads_with_weights_only(tmp_path):
    """optimizer.pt (ZeRO-1) holds the inner optimizer's state dict: torchao's OptimState4bit loads."""
    _, opt = _trained(4)
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    loaded = load_tensors(tmp_path / "optimizer.pt")
    assert type(loaded["state"][0]["exp_avg"]).__name__ == "OptimState4bit"


def test_a_crafted_pickle_is_refused_by_load_tensors(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"state": {}, "param_groups": [Crafted(marker)]}, tmp_path / "optimizer.pt")
    with pytest.raises(UnsafeFileError) as e:
        load_tensors(tmp_path / "optimizer.pt")
    assert not marker.exists()
    line = str(e.value)
    assert "\n" not in line and "optimizer.pt" in line and "it names os.makedirs" in line
    assert line.startswith("refusing to load")


def test_crafted_dcp_metadata_and_items_are_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "ran"
    ckpt = tmp_path / "ckpt"
    dcp.save({"w": torch.zeros(3), "note": Crafted(marker)}, checkpoint_id=str(ckpt))
    assert not marker.exists()  # saving pickles it; only loading would call os.makedirs
    with pytest.raises(UnsafeFileError, match=r"item note\).*it names os.makedirs"):
        dcp_load({"w": torch.ones(3), "note": None}, ckpt)
    assert not marker.exists()
    assert read_metadata(ckpt).state_dict_metadata.keys() == {"w", "note"}  # the real metadata passes
    (ckpt / ".metadata").write_bytes(pickle.dumps(Crafted(marker)))
    for load in (lambda: read_metadata(ckpt), lambda: dcp_load({"w": torch.ones(3)}, ckpt)):
        with pytest.raises(UnsafeFileError, match=r"\.metadata.*it names os.makedirs"):
            load()
    assert not marker.exists()
