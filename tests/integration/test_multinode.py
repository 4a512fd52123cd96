"""`trainplan run` across nodes and inside the user's own launcher (gloo, CPU), two launches of one
two-device plan (tiny-llama, data parallel, 4 steps) shared by the tests below:

- `own`: the user's launcher, `torchrun --standalone --nproc-per-node 2 -m trainplan run PLAN ...`:
  each rank runs `trainplan run` as a worker in its own process (WORLD_SIZE set: nothing is
  launched again); rank 0 alone prints and writes the record and report. The reference.
- `nodes`: two "nodes" of one process each on 127.0.0.1, two `trainplan run --nnodes 2
  --node-rank 0|1 --rdzv-endpoint 127.0.0.1:PORT` started together (c10d rendezvous, a free
  port), sharing the run folder as nodes on a shared filesystem would.

The two-node run's losses equal the single-node ones. A lone node that waits for the other at
the rendezvous fails with a one-line cause, and a failed rank on one node is named there with
its stderr (`run_torchrun` with `Rendezvous`, a stub worker).
"""

from __future__ import annotations

import json
import math
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from trainplan.executor.parallel.launch import Rendezvous, WorkerFailedError, run_torchrun

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
LAUNCH_TIMEOUT_S = 400  # a hang guard, on loaded cores
WORDS = ["the", "king", "is", "dead", "long", "live", "the", "queen", "now", "is", "the", "winter", "of",
         "our", "discontent", "made", "glorious", "summer", "by", "this", "sun", "of", "york"]
WORKER = "tests.integration._parallel_worker"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")  # one thread per rank in both launches: same sums
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _start(argv: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *argv], cwd=cwd, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"{proc.args} hung:\n{err[-3000:]}")
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cpu_profile):
    """(folder, {"own": (rc, stdout, stderr), "node0": ..., "node1": ...}) of the two launches."""
    from trainplan.executor.data.batches import load_corpus
    from trainplan.planner.api import plan_for_choice

    base = tmp_path_factory.mktemp("multinode")
    rng = random.Random(1)
    (base / "tiny.txt").write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(15)) for _ in range(600))
                                   + "\n", encoding="utf-8")
    corpus = load_corpus([base / "tiny.txt"], vocab_size=512)
    plan = plan_for_choice("tiny-llama", cpu_profile, seq_len=64, micro_batch=1, max_steps=STEPS, devices=2,
                           vocab_size=corpus.vocab_size, data_tokens=corpus.n_train_tokens, optimizer_bits=32)
    plan.to_json(base / "plan.json")
    run = ["run", "plan.json", "--data", "tiny.txt"]
    got = {"own": _finish(_start(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                  "--log-dir", "own_logs", "--redirects", "3",
                                  "-m", "trainplan", *run, "--out", "own"], base))}
    port = free_port()
    nodes = [_start(["-m", "trainplan", *run, "--out", "nodes", "--nnodes", "2", "--node-rank", str(r),
                     "--rdzv-endpoint", f"127.0.0.1:{port}"], base) for r in (0, 1)]
    got |= {f"node{r}": _finish(p) for r, p in enumerate(nodes)}
    for name, (rc, out, err) in got.items():
        assert rc == 0, f"{name} exited {rc}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    return base, got


def _losses(folder: Path) -> list[tuple[int, float]]:
    return [tuple(x) for x in json.loads((folder / "record.json").read_text())["train_loss"]]


@pytest.mark.slow
def test_two_nodes_train_the_single_node_losses(runs):
    base, _ = runs
    one, two = _losses(base / "own"), _losses(base / "nodes")
    assert [s for s, _ in two] == list(range(STEPS)), two
    bad = [(s, a, b) for (s, a), (_, b) in zip(two, one, strict=True) if not math.isclose(a, b, rel_tol=1e-6)]
    assert not bad, f"(step, two nodes, one node) train losses differ: {bad}"
    record = json.loads((base / "nodes" / "record.json").read_text())
    assert record["world_size"] == 2 and record["stop_reason"] == "budget", record


@pytest.mark.slow
def test_the_node_of_global_rank_0_reports(runs):
    """c10d assigns the global ranks: whichever node got rank 0 prints the comparison and writes
    the report; the other says where they are. Each node keeps its own logs."""
    base, got = runs
    reporting = [n for n in ("node0", "node1") if "report: nodes/report.html" in got[n][1]]
    assert len(reporting) == 1, {n: got[n][1] for n in ("node0", "node1")}
    other = "node1" if reporting == ["node0"] else "node0"
    assert "global rank 0 ran on another node" in got[other][1] and "run of" not in got[other][1]
    assert (base / "nodes" / "logs" / reporting[0] / "rank0").exists()
    assert not (base / "nodes" / "logs" / other / "rank0").exists()
    assert (base / "nodes" / "report.html").exists()


@pytest.mark.slow
def test_under_the_users_torchrun_each_rank_is_a_worker(runs):
    """Rank 0 prints the table and writes the report; rank 1 prints nothing (errors only); no
    torchrun is started inside a rank (no `logs/` in the run folder)."""
    base, _ = runs
    (attempt,) = (base / "own_logs").glob("*/attempt_0")
    assert "report: own/report.html" in (attempt / "0" / "stdout.log").read_text()
    for name in ("stdout.log", "stderr.log"):
        assert (attempt / "1" / name).read_text() == "", name
    assert not (base / "own" / "logs").exists()
    assert json.loads((base / "own" / "record.json").read_text())["world_size"] == 2


def _nodes(tmp_path: Path, mode: str, ranks: tuple[int, ...], join_timeout_s: float) -> dict:
    """`run_torchrun(WORKER, [mode, ...], 1)` as node r of 2 for each r in `ranks`, at once;
    returns node -> (WorkerFailedError or None, seconds)."""
    port, got = free_port(), {}

    def node(r: int) -> None:
        start = time.monotonic()
        try:
            run_torchrun(WORKER, [mode, str(tmp_path)], 1, timeout_s=60, log_dir=tmp_path / f"node{r}",
                         rendezvous=Rendezvous(2, r, f"127.0.0.1:{port}", join_timeout_s=join_timeout_s))
            got[r] = (None, time.monotonic() - start)
        except WorkerFailedError as e:
            got[r] = (e, time.monotonic() - start)

    threads = [threading.Thread(target=node, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def test_a_lone_node_fails_at_the_rendezvous_instead_of_hanging(tmp_path):
    ((err, took),) = _nodes(tmp_path, "fail", (0,), join_timeout_s=2).values()
    assert isinstance(err, WorkerFailedError) and took < 60, (err, took)
    assert str(err).startswith("node 0 of 2: the c10d rendezvous at 127.0.0.1:"), err
    assert "RendezvousTimeoutError" in str(err) and "not all 2 nodes joined within 2 s" in str(err), err


@pytest.mark.slow
def test_a_failed_rank_on_one_node_is_named_there(tmp_path):
    """Rank 1 raises, rank 0 waits in a barrier: rank 1's node names it with its stderr; rank 0's
    node says its rank lost a peer on another node. Neither hangs."""
    got = _nodes(tmp_path, "fail", (0, 1), join_timeout_s=60)
    errors = [e for e, took in got.values() if e is not None and took < 120]
    assert len(errors) == 2, got
    first = [e for e in errors if e.rank == 1]
    assert len(first) == 1 and "injected failure on rank 1" in str(first[0]), errors
    lost = next(e for e in errors if e.rank == 0)
    assert "a rank on another node probably failed first" in str(lost), lost
