"""trainplan.planner.cli.launching and the multi-node half of trainplan.executor.worker.launch, without starting
torchrun: the node flags and the launcher's environment are checked before the plan is read,
each node starts its share of the processes (and the fit check counts those), and the node
without global rank 0 says so instead of reporting. The launches themselves:
tests/integration/test_multinode.py."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

import trainplan.executor.worker as worker
from trainplan.errors import PlanMismatchError, TrainplanError
from trainplan.executor.parallel.launch import RDZV_JOIN_TIMEOUT_S, Rendezvous
from trainplan.planner.cli.launching import check_launch_flags, check_world, env_rank, is_other_rank, launch_plan
from trainplan.planner.cli.main import build_parser


@pytest.fixture
def no_launcher(monkeypatch):
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _args(*flags: str):
    return build_parser().parse_args(["run", "plan.json", "--out", "out", *flags])


@pytest.mark.parametrize("flags, needle", [
    (["--nnodes", "0"], "--nnodes 0: give the number of nodes, >= 1"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "n0:29500"], "--node-rank 2 is outside 0..1"),
    (["--nnodes", "2", "--node-rank", "-1", "--rdzv-endpoint", "n0"], "--node-rank -1 is outside 0..1"),
    (["--rdzv-endpoint", "n0:29500"], "--rdzv-endpoint without --nnodes above 1 would train on this node alone; "
                                      "add --nnodes N"),
    (["--nnodes", "1", "--node-rank", "0", "--rdzv-id", "j"], "--node-rank, --rdzv-id without --nnodes above 1"),
    (["--node-rank", "1"], "--node-rank without --nnodes above 1 would train on this node alone; add --nnodes N"),
    (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST[:PORT]"),
    (["--nnodes", "2", "--rdzv-endpoint", "n0:port"], "--rdzv-endpoint 'n0:port': The port number"),
    (["--nnodes", "2", "--rdzv-endpoint", ":29500"], "--rdzv-endpoint ':29500': The hostname"),
    (["--nnodes", "2", "--rdzv-endpoint", "n0:0"], "port 0 is not a port to connect to"),
    (["--nnodes", "2", "--rdzv-endpoint", " "], "--rdzv-endpoint ' ': it is empty"),
    (["--nnodes", "2", "--rdzv-endpoint", "n0", "--rdzv-id", ""], "--rdzv-id is empty"),
])
def test_bad_node_flags_are_named(no_launcher, flags, needle):
    with pytest.raises(TrainplanError) as e:
        check_launch_flags(_args(*flags))
    assert needle in str(e.value) and "\n" not in str(e.value), e.value


def test_good_node_flags_give_this_nodes_rendezvous(no_launcher):
    from trainplan.planner.cli.launching import rendezvous

    args = _args("--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "[::1]:29500", "--rdzv-id", "job7")
    assert check_launch_flags(args) is None
    rdzv = rendezvous(args)
    assert rdzv == Rendezvous(2, 1, "[::1]:29500", "job7", RDZV_JOIN_TIMEOUT_S)
    assert rdzv.torchrun_args() == ["--nnodes=2", "--node-rank=1", "--rdzv-backend=c10d",
                                    "--rdzv-endpoint=[::1]:29500", "--rdzv-id=job7",
                                    "--rdzv-conf=join_timeout=600"]
    plain = _args()
    assert check_launch_flags(plain) is None and (plain.nnodes, plain.node_rank) == (1, 0)
    assert rendezvous(plain) is None  # torchrun --standalone, as before


@pytest.mark.parametrize("env, expect", [
    ({}, None),
    ({"WORLD_SIZE": "2", "RANK": "1"}, (1, 2)),
    ({"WORLD_SIZE": "1"}, (0, 1)),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 in the environment but RANK is not set"),
    ({"WORLD_SIZE": "two", "RANK": "0"}, "WORLD_SIZE='two' in the environment is not a whole number"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 in the environment is outside 0..1 (WORLD_SIZE=2)"),
    ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE=0 in the environment must be >= 1"),
])
def test_the_launchers_environment(no_launcher, env, expect):
    for k, v in env.items():
        no_launcher.setenv(k, v)
    if isinstance(expect, str):
        with pytest.raises(TrainplanError, match=expect.replace("(", r"\(").replace(")", r"\)")):
            env_rank()
        return
    got = env_rank()
    assert (got if got is None else (got.rank, got.world)) == expect
    assert is_other_rank() == bool(expect and expect[0] > 0)


def test_node_flags_under_a_launcher_are_refused(no_launcher):
    no_launcher.setenv("WORLD_SIZE", "2")
    no_launcher.setenv("RANK", "0")
    with pytest.raises(TrainplanError, match=r"--nnodes, --rdzv-endpoint: this process is rank 0 of WORLD_SIZE=2"):
        check_launch_flags(_args("--nnodes", "2", "--rdzv-endpoint", "n0"))
    env = check_launch_flags(_args())
    assert (env.rank, env.world) == (0, 2)


def test_processes_must_match_the_plan():
    from trainplan.planner.cli.launching import EnvRank

    assert worker.processes_per_node(8, 2) == 4 and worker.processes_per_node(3, 1) == 3
    with pytest.raises(PlanMismatchError, match=r"3 device\(s\), which --nnodes 2 cannot split equally.*one of 1, 3"):
        check_world(None, 3, 2)
    with pytest.raises(PlanMismatchError, match=r"WORLD_SIZE=4 in the environment .* the plan uses 2 device\(s\)"):
        check_world(EnvRank(0, 4), 2, 1)
    check_world(EnvRank(1, 2), 2, 1)


@pytest.fixture(scope="module")
def plan8(cpu_profile):
    from trainplan.planner.api import plan_for_choice

    return plan_for_choice("tiny-llama", cpu_profile, seq_len=64, micro_batch=1, devices=8, max_steps=2)


def test_each_node_starts_its_share_and_the_fit_check_counts_those(plan8, tmp_path, monkeypatch):
    """On 1 core at most CPU_PROCESSES_PER_CORE (4) processes fit: all 8 of the plan do not,
    2 nodes x 4 do; each node's torchrun gets 4 processes, its rendezvous, its own log folder
    and plan copy, and the file global rank 0 marks."""
    import trainplan.executor.fit_check as fit
    from trainplan.executor.fit_check import PlanDoesNotFitError

    monkeypatch.setattr(fit.os, "cpu_count", lambda: 1)
    plan8.to_json(tmp_path / "plan.json")
    calls = []
    monkeypatch.setattr(worker, "run_torchrun", lambda module, args, nproc, **k: calls.append((args, nproc, k)))
    with pytest.raises(PlanDoesNotFitError, match=r"plan runs 8 processes \(one per device\) but"):
        worker.launch(tmp_path / "plan.json", tmp_path / "run", None, "cpu", threads=1)
    nodes = Rendezvous(2, 1, "127.0.0.1:29500")
    assert worker.launch(tmp_path / "plan.json", tmp_path / "run", None, "cpu", threads=1, nodes=nodes) is False
    ((args, nproc, kw),) = calls
    log_dir = tmp_path / "run" / "logs" / "node1"
    assert nproc == 4 and kw["rendezvous"] == nodes and kw["log_dir"] == log_dir
    assert args[0] == str(log_dir / "plan.json") and (log_dir / "plan.json").exists()
    assert args[-2:] == ["--rank0-file", str(log_dir / "rank0")]
    assert not (tmp_path / "run" / "plan.json").exists()  # rank 0's worker writes that one
    assert not worker.hosted_rank0(tmp_path / "run", nodes)
    (log_dir / "rank0").write_text("host\n")
    assert worker.hosted_rank0(tmp_path / "run", nodes) and worker.hosted_rank0(tmp_path / "run")


def test_the_node_without_rank_0_says_so(tmp_path, monkeypatch, capsys, no_launcher):
    """`launch_plan` reads the record only on the node that ran global rank 0; another node
    prints one line (exit 0), or is interrupted (exit 130) when its job was."""
    import trainplan.executor.reporting.report as report

    seen = {"interrupted": False}
    monkeypatch.setattr(worker, "launch", lambda plan_path, out, data, device, **k: seen["interrupted"])
    monkeypatch.setattr(report, "load_run", lambda out: ("plan", "record"))
    args = _args("--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:29500")
    check_launch_flags(args)
    plan = types.SimpleNamespace(decisions=types.SimpleNamespace(devices=2))
    assert launch_plan(plan, Path("plan.json"), tmp_path, args) is None
    assert capsys.readouterr().out.startswith("node 1 of 2: its 1 process(es) finished; global rank 0 ran on "
                                              "another node")
    seen["interrupted"] = True
    with pytest.raises(KeyboardInterrupt):
        launch_plan(plan, Path("plan.json"), tmp_path, args)
    (tmp_path / "logs" / "node1").mkdir(parents=True)
    (tmp_path / "logs" / "node1" / "rank0").write_text("host\n")
    assert launch_plan(plan, Path("plan.json"), tmp_path, args) == ("plan", "record")


@pytest.mark.parametrize("env, reason, expect", [
    ((1, 2), "budget", 0), ((1, 2), "interrupted", 130), ((0, 2), "interrupted", "reports"),
    (None, "budget", "reports"),
])
def test_a_rank_of_the_users_launcher_trains_in_place(monkeypatch, no_launcher, env, reason, expect):
    """Under the user's torchrun each rank runs `trainplan.executor.train.run` itself (no launch); rank 0
    gets (plan, record) to report, another rank only its exit status."""
    import trainplan.executor.train
    from trainplan.planner.cli.launching import EnvRank, run_processes

    record = types.SimpleNamespace(stop_reason=reason)
    monkeypatch.setattr(trainplan.executor.train, "run", lambda plan, **k: record)
    monkeypatch.setattr(worker, "launch", lambda *a, **k: pytest.fail("launched torchrun inside a rank"))
    plan = types.SimpleNamespace(decisions=types.SimpleNamespace(devices=2 if env else 1))
    args = _args()
    got = run_processes(plan, Path("plan.json"), None, Path("out"), args, env and EnvRank(*env))
    assert got == (expect if expect != "reports" else (plan, record))
