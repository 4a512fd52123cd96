"""A tiled loss over 2 processes (FSDP2 ZeRO-3, gloo): the LM head's tiled loss runs inside the
model's forward (`trainplan.modeling.tiling.TiledHead`), where FSDP2 holds the root group's parameters
unsharded; the losses equal one process's untiled run's."""

from __future__ import annotations

import json

import pytest

from tests.integration import _tiled_loss_worker as worker
from trainplan.executor.parallel.launch import run_torchrun


def test_tiled_loss_under_fsdp2_zero3_trains_as_one_untiled_process(tmp_path, torch_threads):
    with torch_threads(1):
        worker.main(str(tmp_path / "one.json"), 1, 1, 0)
    run_torchrun("tests.integration._tiled_loss_worker", [str(tmp_path / "two.json"), "2", "4", "3"], 2,
                 timeout_s=300, log_dir=tmp_path / "logs")
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert two == pytest.approx(one, rel=1e-5), (one, two)
