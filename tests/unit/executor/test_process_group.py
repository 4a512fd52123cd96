"""trainplan.executor.parallel.launch's process-group lifetime: the group `init_distributed`
creates is destroyed at exit while the interpreter is alive (a gloo group left to finalization can
abort the process with SIGABRT, which CI once hit in tests/integration/test_own_loop.py), except
after an uncaught exception, where destroying could wait on peers stuck in a collective."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from trainplan.executor.parallel import launch


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_init_distributed_registers_the_exit_hook(monkeypatch, tmp_path):
    registered, created = [], []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setattr(launch.atexit, "register", registered.append)
    monkeypatch.setattr(launch.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(launch.dist, "init_process_group", lambda **kw: created.append(kw))
    assert launch.init_distributed(torch.device("cpu")) == (0, 2)
    assert [c["backend"] for c in created] == ["gloo"] and registered == [launch.destroy_at_exit]


def test_exit_hook_destroys_the_group(one_rank_group, monkeypatch):
    monkeypatch.delattr(sys, "last_value", raising=False)
    launch.destroy_at_exit()
    assert not dist.is_initialized()
    launch.destroy_at_exit()  # a second call (the user destroyed it already) is a no-op


def test_exit_hook_leaves_the_group_after_an_uncaught_exception(one_rank_group, monkeypatch):
    monkeypatch.setattr(sys, "last_value", RuntimeError("a rank failed"), raising=False)
    launch.destroy_at_exit()
    assert dist.is_initialized()
