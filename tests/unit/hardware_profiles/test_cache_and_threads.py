"""The cache root (`trainplan.hardware_profiles.cache`): one function, platformdirs under it, the
TRAINPLAN_CACHE_DIR override kept; and the threads per rank (`trainplan.hardware_profiles.threads`) that
runs use and the cpu profile is keyed by."""

import json
import os
import sys
from pathlib import Path

import pytest

from trainplan.errors import TrainplanError
from trainplan.hardware_profiles import cpu
from trainplan.hardware_profiles.cache import cache_root
from trainplan.hardware_profiles.threads import threads_per_rank, torch_threads, usable_cores, user_threads

ROOT = Path(__file__).resolve().parents[3]
FOLDERS = ("trainplan", "hardware_profiles", "costmodels", "modeling", "planner", "executor")
"""The source folders (tests/unit/test_import_graph.py says why these)."""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="platformdirs reads XDG_CACHE_HOME on Linux")
def test_every_cache_lands_under_xdg_cache_home(monkeypatch, tmp_path, cpu_profile):
    from trainplan.costmodels.data.quality_cache import quality_path
    from trainplan.costmodels.loss.cache import law_path
    from trainplan.executor.reporting.figures import calibration_history_path

    monkeypatch.delenv("TRAINPLAN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = tmp_path / "xdg" / "trainplan"
    assert cache_root() == root
    assert cpu.cache_path() == root / "hardware" / "cpu.json"
    assert law_path("tiny-llama", 512) == root / "laws" / "tiny-llama-v512.json"
    assert quality_path("tiny-llama", 512) == root / "quality" / "tiny-llama-v512.json"
    assert calibration_history_path() == root / "calibration_history.csv"
    # a file written through the cache lands there
    monkeypatch.setattr(cpu, "_MEMO", {})
    path = cpu.save_profile(cpu_profile)
    assert path == root / "hardware" / "cpu.json" and json.loads(path.read_text())["profile"]["name"] == "cpu"


def test_the_override_and_an_explicit_folder_win(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("TRAINPLAN_CACHE_DIR", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert cache_root(tmp_path / "mine") == tmp_path / "mine"
    monkeypatch.setenv("TRAINPLAN_CACHE_DIR", "~/tp")
    assert cache_root() == Path.home() / "tp"


def test_cache_paths_are_built_in_one_place():
    """No package module but hardware_profiles/cache.py builds a cache folder from the home
    directory or platformdirs."""
    offenders = []
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            if path == ROOT / "hardware_profiles" / "cache.py":
                continue
            text = path.read_text()
            offenders += [f"{path.relative_to(ROOT)}: {needle}" for needle in
                          ("expanduser", "Path.home", '".cache"', "'.cache'", "platformdirs") if needle in text]
    assert not offenders, offenders


def test_threads_per_rank(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = usable_cores()
    assert 1 <= cores <= (os.cpu_count() or 1)
    assert threads_per_rank(1) == cores
    assert threads_per_rank(2) == max(1, cores // 2)
    assert threads_per_rank(4 * cores) == 1  # at least one
    assert threads_per_rank(2, threads=3) == 3  # an explicit count wins
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert threads_per_rank(1) == threads_per_rank(8) == 5 and user_threads() == 5
    assert threads_per_rank(1, threads=2) == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "4,2")  # OpenMP's nested form: the first level
    assert threads_per_rank(1) == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "")
    assert user_threads() is None and threads_per_rank(1) == cores


@pytest.mark.parametrize("env, call, message", [
    ("0", lambda: threads_per_rank(1), "OMP_NUM_THREADS='0' must be a whole number of threads >= 1"),
    ("two", lambda: threads_per_rank(1), "OMP_NUM_THREADS='two' must be a whole number"),
    (None, lambda: threads_per_rank(0), "ranks=0 must be a whole number of threads >= 1"),
    (None, lambda: threads_per_rank(1, threads=True), "threads=True must be a whole number"),
    (None, lambda: threads_per_rank(1, threads=1.5), "threads=1.5 must be a whole number"),
])
def test_bad_thread_counts_are_typed_errors(monkeypatch, env, call, message):
    if env is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    with pytest.raises(TrainplanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call()


def test_torch_threads_restores():
    import torch

    before = torch.get_num_threads()
    with torch_threads(1 if before != 1 else 2) as n:
        assert torch.get_num_threads() == n
    assert torch.get_num_threads() == before


def test_cpu_profile_is_keyed_and_measured_at_the_run_threads(monkeypatch):
    """The cache key's thread count is the one a one-process run uses (OMP_NUM_THREADS here),
    whatever torch's threads in the calling process; measure_cpu sets it and restores torch's."""
    import torch

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    with torch_threads(1):
        assert cpu._host_key()[2] == 3
        seen = []
        monkeypatch.setattr(cpu.probes, "matmul_rates", lambda *a: seen.append(torch.get_num_threads()) or [(1e6, 1e9)])
        monkeypatch.setattr(cpu.probes, "copy_bandwidth", lambda quick: 1e10)
        monkeypatch.setattr(cpu.probes, "op_overhead_s", lambda quick: 1e-5)
        monkeypatch.setattr(cpu.probes, "optimizer_s_per_param", lambda quick: {"32": 1e-9})
        monkeypatch.setattr(cpu.probes, "loopback_tcp_bandwidth", lambda quick: 1e9)
        profile = cpu.measure_cpu(quick=True)
        assert set(seen) == {3} and "3 torch threads" in profile.source
        assert torch.get_num_threads() == 1  # restored
        cpu.measure_cpu(quick=True, threads=2)
        assert set(seen) == {3, 2} and torch.get_num_threads() == 1
