"""Solve time against graph size: the per-block rematerialization model and the joint plan.

    python benchmarks/solve_speed.py [--quick | --smoke] [--out DIR]

`--smoke` (the test suite's run): the llama3-70b joint solve and the tiny-llama block only; the
405b keys are null and its target is not checked.

Per block: one transformer block of each preset (tiny-llama, llama3-8b, llama3-70b,
llama3.1-405b) and, to grow the graph past one layer, a "block" of k tiny-llama layers run as
one checkpointed region, 16 such blocks stacked (k = 2, 4, 8; 4, 8 only in the full grid;
past about 150 decisions the 1 s time limit can end a solve before optimality is proven, and
the row's `gap` says how far). For each: the captured
forward+backward graph's size, the CP-SAT model's size, the seconds of one solve at a cap
halfway between full and no checkpointing (`block_solve_s`) and of the block's whole Pareto
menu (`menu_s`). Joint: `trainplan.planner.solve` for llama3-70b (80 layers) at 131,072 tokens on
8 x mi300, end to end (capture, menus, joint CP-SAT model), in a process where torch and the
transformers Llama module are already imported (`solve_s_llama3_70b`); the same solve's
capture and solver parts are reported beside it. Scale: the same for llama3.1-405b (126 layers)
at 8,192 tokens on 1024 x mi300, 128 nodes of 8 (SP inside a node, data parallelism across
nodes; `solve_s_405b_1024`, target 10 s). Frontier: `trainplan.planner.joint.frontier` for llama3-8b on 8 x h100
at 8,192 tokens (`frontier_s_llama3_8b`; not with --quick). torch and CP-SAT use 2 threads.

Writes DIR/solve_speed.csv (one row per graph) and DIR/solve_speed.json (summary), prints the
summary last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import time
from pathlib import Path

import pandas as pd
import torch
from torch import nn

THREADS = 2


class LayerStack(nn.Module):
    """k decoder layers run as one block (one checkpointed region)."""

    def __init__(self, layers):
        super().__init__()
        self.inner = nn.ModuleList(layers)

    def forward(self, hidden_states, **kwargs):
        for layer in self.inner:
            out = layer(hidden_states, **kwargs)
            hidden_states = out[0] if isinstance(out, tuple) else out
        return hidden_states


def stacked_tiny(k: int) -> nn.Module:
    """tiny-llama with its 4 layers grouped into one block of k layers (repeated 4 // k times,
    at least once)."""
    from trainplan.modeling.presets import build_model

    model = build_model("tiny-llama", device="meta", vocab_size=2048)
    layers = list(model.model.layers)
    while len(layers) < k:
        layers += list(build_model("tiny-llama", device="meta", vocab_size=2048).model.layers)
    model.model.layers = nn.ModuleList([LayerStack(layers[i:i + k]) for i in range(0, len(layers), k)])
    model.model.config.num_hidden_layers = len(model.model.layers)
    return model


def block_row(name: str, region, hw: str, b: int, s: int, sp: int, stack: int) -> dict:
    from trainplan.costmodels.checkpoint_sets import BUILTIN
    from trainplan.costmodels.step.remat_cost import BlockCase, evaluate
    from trainplan.hardware_profiles import load
    from trainplan.planner.joint.remat_solver import BlockModel, pareto_menu

    case = BlockCase(region=region, b=b, s=s, sp=sp, hw=load(hw), dtype="bf16", stack=stack)
    t0 = time.perf_counter()
    bm = BlockModel(case)
    build_s = time.perf_counter() - t0
    lo, hi = (evaluate(case, BUILTIN[e]).peak_bytes for e in ("full", "none"))
    sol = bm.solve(lo + 0.5 * (hi - lo))
    t0 = time.perf_counter()
    menu = pareto_menu(case)
    menu_s = time.perf_counter() - t0
    return dict(graph=name, hw=hw, micro_batch=b, seq_local=s, fwd_nodes=len(region.fwd_nodes()),
                graph_nodes=region.graph.number_of_nodes(), candidates=len(bm.lm.candidates),
                model_constraints=len(bm.model.proto.constraints), build_s=build_s,
                block_solve_s=build_s + sol.wall_s, status=sol.status,
                gap=(sol.bound_ps - sol.avoided_ps) / sol.bound_ps if sol.bound_ps else float("nan"),
                menu_s=menu_s,
                menu_entries=len(menu.entries), menu_solves=menu.solves)


def joint_70b() -> dict:
    return joint("llama3-70b", 8, 131072, 5000.0)


def joint_405b_1024() -> dict:
    """llama3.1-405b (126 layers) at 8,192 tokens on 1024 x mi300 (128 nodes of 8): SP inside
    a node, data parallelism across nodes, 1e6 device-hours."""
    return joint("llama3.1-405b", 1024, 8192, 1e6)


def joint(model: str, devices: int, seq_len: int, device_hours: float) -> dict:
    """`trainplan.planner.solve` end to end for `model` on `devices` x mi300 at `seq_len` tokens."""
    from trainplan.planner.api import solve
    from trainplan.planner.budget import Budget

    t0 = time.perf_counter()
    plan = solve(model, "mi300", Budget(devices=devices, device_hours=device_hours), seq_len=seq_len)
    total = time.perf_counter() - t0
    d = plan.decisions
    return dict(graph=f"joint {model} {seq_len // 1024}k {devices}xmi300", solve_s=total,
                capture_s=total - plan.solver.wall_s, sp_degree=d.sp_degree, dp_degree=d.dp_degree,
                zero_stage=d.zero_stage, micro_batch=d.micro_batch,
                solver_s=plan.solver.wall_s, status=plan.solver.status,
                joint_variables=plan.solver.n_variables, joint_constraints=plan.solver.n_constraints,
                checkpoint=", ".join(f"{d.activation_checkpoint.count(e)} x {e}"
                                     for e in dict.fromkeys(d.activation_checkpoint)),
                predicted_step_s=plan.predictions.step_time_s, predicted_loss=plan.predictions.final_loss)


def frontier_8b() -> float:
    """Seconds of `trainplan.planner.joint.frontier` for llama3-8b on 8 x h100 at 8,192 tokens (1000
    device-hours): the joint solve at every rung of its budget and memory-cap ladder (about 30 s
    on 2 idle cores; tests/unit/planner/test_frontier.py checks the frontier itself)."""
    from trainplan.planner.budget import Budget
    from trainplan.planner.joint.frontier import frontier

    t0 = time.perf_counter()
    frontier("llama3-8b", "h100", Budget(devices=8, device_hours=1000), seq_len=8192)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer graphs, well under a minute")
    ap.add_argument("--smoke", action="store_true",
                    help="the llama3-70b joint solve and the tiny-llama block only (the test suite's run)")
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(THREADS)
    from trainplan.planner.capture.graph import capture
    from trainplan.planner.capture.setup import capture_model

    capture_model("tiny-llama", "bf16-mixed")  # warm: imports and tracing machinery
    capture_s = {}
    # the capture alone, as a solve on mi300 runs it (issue #20)
    for name in ("llama3-70b",) if a.smoke else ("llama3-70b", "llama3.1-405b"):
        t0 = time.perf_counter()
        capture_model(name, "bf16-mixed", device_type="cuda")
        capture_s[name] = time.perf_counter() - t0
        print(f"  capture {name}: {capture_s[name]:.2f} s", flush=True)
    joint = joint_70b()  # before the block rows, which capture llama3-70b too
    print(f"  {joint['graph']}: {joint['solve_s']:.2f} s ({joint['checkpoint']})", flush=True)
    big = None if a.smoke else joint_405b_1024()
    if big is not None:
        print(f"  {big['graph']}: {big['solve_s']:.2f} s (sp {big['sp_degree']} x dp {big['dp_degree']}, "
              f"zero {big['zero_stage']}, {big['checkpoint']})", flush=True)
    frontier_s = None if a.quick or a.smoke else frontier_8b()
    if frontier_s is not None:
        print(f"  frontier llama3-8b, 8 x h100, seq 8192: {frontier_s:.2f} s", flush=True)
    rows = []
    presets = [("tiny-llama", 1, 4096, 1, 4), ("llama3-8b", 1, 8192, 1, 32),
               ("llama3-70b", 1, 16384, 8, 80), ("llama3.1-405b", 1, 16384, 8, 126)]
    for name, b, s, sp, stack in presets[:1] if a.smoke else presets[::3] if a.quick else presets:
        region = capture_model(name, "bf16-mixed")[0].regions["block0"]
        rows.append(block_row(name, region, "mi300", b, s, sp, stack))
    for k in () if a.smoke else (2,) if a.quick else (2, 4, 8):
        region = capture(stacked_tiny(k), dtype=torch.bfloat16).regions["block0"]
        rows.append(block_row(f"tiny-llama x{k} layers", region, "mi300", 1, 4096, 1, 16))
    for r in rows:
        print(f"  {r['graph']:24s} {r['graph_nodes']:5d} nodes {r['candidates']:4d} decisions "
              f"solve {r['block_solve_s']:.3f} s menu {r['menu_s']:.3f} s", flush=True)
    df = pd.DataFrame(rows + [joint] + ([big] if big else []))
    df.to_csv(out / "solve_speed.csv", index=False)
    blocks = pd.DataFrame(rows)
    summary = {
        "solve_s_llama3_70b": joint["solve_s"],
        "solve_s_llama3_70b_capture": joint["capture_s"],
        "capture_s_llama3_70b": capture_s["llama3-70b"],
        "capture_s_llama3_405b": capture_s.get("llama3.1-405b"),
        "solve_s_llama3_70b_solver": joint["solver_s"],
        "solve_s_405b_1024": big["solve_s"] if big else None,
        "solve_s_405b_1024_solver": big["solver_s"] if big else None,
        "block_solve_s_max": float(blocks["block_solve_s"].max()),
        "block_menu_s_max": float(blocks["menu_s"].max()),
        "largest_block_graph_nodes": int(blocks["graph_nodes"].max()),
        "frontier_s_llama3_8b": frontier_s,
        "targets_met": bool(joint["solve_s"] <= 5.0 and blocks["block_solve_s"].max() <= 2.0
                            and (big is None or big["solve_s"] <= 10.0)),
        "quick": a.quick, "smoke": a.smoke,
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {THREADS} threads",
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    (out / "solve_speed.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
