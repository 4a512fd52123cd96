"""CPU threads (`trainplan.hardware_profiles.threads`): a run sets torch's threads per rank and the `cpu`
profile that predicts it is measured at the same count; a 2-thread run's step time on an
otherwise idle machine is within the profile's prediction band.

The band test measures the machine's CPU use by other processes (/proc/stat less this process's
own CPU time) before it starts, while it measures the profile and while the plan runs, and
skips, saying so, when others used more than `IDLE_CORES` in any of them: a 2-thread step on a
2-core machine that another job shares waits on its descheduled OpenMP worker (issue 24 saw
150x), and so does the 2-thread measurement of the profile, so neither number means anything
then. CI runs the suite alone on its machine, where the test runs; on a shared development
machine it mostly skips.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import trainplan.executor.train as train
import trainplan.executor.worker as worker
from trainplan.executor.data.batches import load_corpus

THREADS = 2
IDLE_CORES = 0.1
"""Most CPU (in cores, averaged) other processes may use while the profile is measured, and
again while the plan runs (on the idle 2-core development machine they used 0.00-0.07; a burst
of 0.2 cores over the profile's measurement made its 2-thread prediction 20x too slow)."""
BAND = 3.0
"""The prediction band of an uncalibrated, quick-measured `cpu` profile: the fastest timed step
within a factor of 3 of the predicted step time either way. On the idle 2-core development
machine this test's step measured 0.80x to 1.43x its prediction in 7 runs (docs/accuracy.md's
uncalibrated median: 20% too fast); the fault it guards against, threads contending for cores,
made a step 150x slower than predicted, and with one busy process beside this test its profile
and run were 0.04x to 6x apart (such runs skip)."""
TEXT = "\n".join(f"Line {i}: to be or not to be, that is the question {i % 7}." for i in range(4000))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(TEXT)
    return load_corpus([path], vocab_size=320, cache_dir=path.parent / "cache")


def _busy_s() -> float | None:
    """CPU seconds all processes have used since boot (/proc/stat: all but idle and iowait)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """Cores' worth of CPU that other processes used since `start()` (this process excluded)."""

    def start(self) -> OtherLoad:
        self.busy, self.own, self.wall = _busy_s(), time.process_time(), time.perf_counter()
        return self

    def cores(self) -> float:
        busy = _busy_s()
        if busy is None or self.busy is None:
            return float("inf")
        wall = max(time.perf_counter() - self.wall, 1e-3)
        return max(0.0, (busy - self.busy) - (time.process_time() - self.own)) / wall


def _skip_unless_idle(load: OtherLoad, when: str) -> None:
    cores = load.cores()
    if cores > IDLE_CORES:
        pytest.skip(f"machine not idle {when}: other processes used {cores:.2f} cores (at most "
                    f"{IDLE_CORES} for a 2-thread step time to mean anything)")


@pytest.mark.serial
@pytest.mark.skipif((os.cpu_count() or 1) < THREADS or not Path("/proc/stat").exists(),
                    reason=f"needs {THREADS} cores and /proc/stat")
def test_two_thread_run_within_the_profile_band(tmp_path, monkeypatch, corpus):
    import torch

    from trainplan.hardware_profiles import cpu, load
    from trainplan.planner.api import plan_for_choice

    probe = OtherLoad().start()
    time.sleep(0.5)
    _skip_unless_idle(probe, "before the test")
    monkeypatch.setenv("TRAINPLAN_CACHE_DIR", str(tmp_path / "cache"))  # a fresh profile ...
    monkeypatch.setenv("OMP_NUM_THREADS", str(THREADS))  # ... measured at the threads runs use
    monkeypatch.setattr(cpu, "_MEMO", {})
    before = torch.get_num_threads()
    probe = OtherLoad().start()
    cpu.save_profile(cpu.measure_cpu(quick=True))  # what load("cpu") measures, in a second
    _skip_unless_idle(probe, "while the profile was measured")
    profile = load("cpu")  # from the cache: its key is the run's thread count
    assert f"{THREADS} torch threads" in profile.source and "(quick)" in profile.source
    assert torch.get_num_threads() == before
    probe = OtherLoad().start()
    plan = plan_for_choice("tiny-llama", profile, seq_len=64, micro_batch=2, max_steps=10,
                           vocab_size=corpus.vocab_size)
    seen = []

    def measured(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    real = train.measured_step
    monkeypatch.setattr(train, "measured_step", measured)
    rec = train.run(plan, data=corpus, out=tmp_path / "run", progress=False, checkpoint_every=0)
    assert set(seen) == {THREADS} and torch.get_num_threads() == before  # set for the steps, restored
    _skip_unless_idle(probe, "while the plan ran")
    predicted, measured_s = plan.predictions.step_time_s, min(rec.step_times_s[2:])
    assert 1 / BAND <= measured_s / predicted <= BAND, (
        f"2-thread step {measured_s * 1e3:.1f} ms against {predicted * 1e3:.1f} ms predicted by a "
        f"profile measured at {THREADS} threads (all timed steps: {rec.step_times_s})")


def test_run_threads_argument_wins_over_the_environment(tmp_path, monkeypatch, corpus, cpu_profile):
    """`run(threads=1)` under OMP_NUM_THREADS=2: the steps run at 1 thread, restored after."""
    import torch

    from trainplan.planner.api import plan_for_choice

    plan = plan_for_choice("tiny-llama", cpu_profile, seq_len=32, micro_batch=1, max_steps=4,
                           vocab_size=corpus.vocab_size)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    seen = []
    real = train.measured_step
    monkeypatch.setattr(train, "measured_step", lambda *a, **k: seen.append(torch.get_num_threads()) or real(*a, **k))
    before = torch.get_num_threads()
    train.run(plan, data=corpus, out=tmp_path / "run", progress=False, checkpoint_every=0, threads=1)
    assert seen == [1] * 4 and torch.get_num_threads() == before


def test_launch_gives_each_rank_its_share_of_the_cores(tmp_path, monkeypatch):
    """`launch` passes OMP_NUM_THREADS = usable cores // ranks to torchrun's workers (torchrun
    would set 1), or the user's OMP_NUM_THREADS, or its `threads` argument."""
    from trainplan.hardware_profiles.threads import usable_cores

    plan = SimpleNamespace(decisions=SimpleNamespace(devices=2, max_steps=3),
                           predictions=SimpleNamespace(step_time_s=1.0),
                           to_json=lambda path: Path(path).write_text("{}"))
    monkeypatch.setattr(worker.Plan, "from_json", lambda path: plan)
    envs = []
    monkeypatch.setattr(worker, "run_torchrun", lambda *a, env=None, **k: envs.append(env))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    worker.launch(tmp_path / "plan.json", tmp_path / "out", None, None, check_fits=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    worker.launch(tmp_path / "plan.json", tmp_path / "out", None, None, check_fits=False)
    worker.launch(tmp_path / "plan.json", tmp_path / "out", None, None, check_fits=False, threads=5)
    assert envs == [{"OMP_NUM_THREADS": str(max(1, usable_cores() // 2))}, {"OMP_NUM_THREADS": "3"},
                    {"OMP_NUM_THREADS": "5"}]

