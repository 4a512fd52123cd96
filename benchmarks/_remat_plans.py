"""The plans of benchmarks/remat.py: each strategy's best plan under a memory cap at one
(sequence, micro-batch), its predicted peak and step time, and the fixed Plan a run executes.

Every prediction uses one `cpu` profile and one capture of the model (`Planner`); the solver's
plans come from one prepared problem per micro-batch (`trainplan.planner.joint.problem.prepare`, then
`solve_problem` per sequence and cap: `trainplan.planner.api.solve` without its capture per call).
"""

from __future__ import annotations

MODEL, VOCAB, STEPS = "tiny-llama", 2048, 4
MIB = 2**20
LADDER = tuple(sorted({int(round(128 * 1.1**k / 8)) * 8 for k in range(45)}))
"""Sequence lengths tried: 128 to 8480, x1.1 apart (multiples of 8)."""
NAMED = {"no_ac": "none", "full_ac": "full", "autosp": "save_attention", "full_ac_tiled": "full"}
"""Strategies with one named checkpoint entry for every block."""
LOSS_CHUNKS, MLP_CHUNKS = (1, 2, 4, 8, 16, 32), (1, 2, 4, 8)
"""Chunk counts of the tiled loss and the tiled MLP the `trainplan` strategy searches (powers
of two, 1 = not tiled; `trainplan.planner.joint.combos.long_context_combos`): searched wherever they may
pay, not only where nothing fits without them."""
SOLVER_BUDGET_S = 10**7
"""Wall-clock budget of every solve, s: a time budget, so that of the plans that reach the
solver's token level its polish takes the one with the fewest seconds per token
(`trainplan.planner.joint.solver.solve_joint`): the fastest plan that fits the cap by the cost model."""


class Planner:
    """Predicted peak and step time of each strategy's plan at one (sequence, micro-batch)."""

    def __init__(self):
        from trainplan.hardware_profiles import load
        from trainplan.planner.capture.setup import setup_model
        from trainplan.planner.joint.space import default_tiling

        self.hw = load("cpu")  # once: every prediction of the run uses the same profile
        _, self.precision, graph, _, self.sm = setup_model(MODEL, self.hw, precision=None, vocab_size=VOCAB)
        self.L = graph.n_layers
        t = default_tiling(vocab_size=graph.vocab_size, hidden_size=graph.hidden_size,
                           intermediate_size=graph.intermediate_size,
                           act_bytes=4 if self.precision == "fp32" else 2, unified_memory=self.hw.unified_memory)
        self.tiling = max(t["loss_chunks"]), max(t["mlp_chunks"])
        """(loss_chunks, mlp_chunks) of `full_ac_tiled`: `default_tiling`'s counts."""
        self._problems: dict[int, object] = {}

    def _choice(self, seq, mb, policies, sets=(), chunks=(1, 1)):
        from trainplan.costmodels.step.model import Choice

        return Choice(sp_degree=1, zero_stage=0, micro_batch=mb, seq_len=seq, policies=policies,
                      precision=self.precision, optimizer_bits=32, devices=1, sets=tuple(sets),
                      loss_chunks=chunks[0], mlp_chunks=chunks[1])

    def plan(self, strategy: str, seq: int, mb: int, cap: float) -> dict | None:
        """{policies, sets, loss_chunks, mlp_chunks, peak, step_s} of the strategy's best
        fitting plan, or None."""
        if strategy in NAMED:
            chunks = self.tiling if strategy == "full_ac_tiled" else (1, 1)
            return self._fits(self._choice(seq, mb, (NAMED[strategy],) * self.L, chunks=chunks), cap)
        if strategy == "torch_knapsack":
            from trainplan.planner.joint.remat_menu import block_case
            from trainplan.planner.joint.remat_strategies import BUDGETS, knapsack_set

            case = block_case(self.sm, self._choice(seq, mb, ("none",) * self.L))
            options = [self._fits(self._choice(seq, mb, ("none",) * self.L), cap)]
            for entry in {knapsack_set(case, b, "dp") for b in BUDGETS}:
                options.append(self._fits(self._choice(seq, mb, (entry.name,) * self.L, [entry]), cap))
            options = [o for o in options if o]
            return min(options, key=lambda o: o["step_s"]) if options else None
        return self._solve(seq, mb, cap)

    def _fits(self, c, cap):
        cost = self.sm.evaluate(c)
        if cost.memory.total > cap:
            return None
        return dict(policies=c.policies, sets={x.name: sorted(x.saved) for x in c.sets},
                    loss_chunks=c.loss_chunks, mlp_chunks=c.mlp_chunks, peak=cost.memory.total,
                    step_s=cost.time_s, phase=cost.memory.phase)

    def _problem(self, mb: int):
        from trainplan.planner.joint.problem import prepare

        if mb not in self._problems:
            self._problems[mb] = prepare(MODEL, self.hw, seq_len=LADDER[0], vocab_size=VOCAB, micro_batches=(mb,),
                                         optimizer_bits=(32,), data_fractions=(1.0,),
                                         loss_chunks=LOSS_CHUNKS, mlp_chunks=MLP_CHUNKS)
        return self._problems[mb]

    def _solve(self, seq, mb, cap):
        from trainplan.costmodels.step.model import Choice
        from trainplan.errors import InfeasibleError
        from trainplan.planner.budget import Budget
        from trainplan.planner.joint.problem import solve_problem

        try:
            p = solve_problem(self._problem(mb), Budget(wall_clock_s=SOLVER_BUDGET_S), seq_len=seq,
                              memory_limit_bytes=cap, diagnose=False)  # a search probe: no diagnosis
        except InfeasibleError:
            return None
        d = p.decisions
        return dict(policies=d.activation_checkpoint, sets=d.checkpoint_sets, loss_chunks=d.loss_chunks,
                    mlp_chunks=d.mlp_chunks, peak=p.predictions.memory_bytes["total"],
                    step_s=p.predictions.step_time_s, solve_s=p.solver.wall_s,
                    phase=self.sm.evaluate(Choice.from_decisions(d)).memory.phase)

    def longest(self, strategy: str, mb: int, cap: float, max_seq: int | None = None) -> int:
        """Index in LADDER of the longest sequence, at most `max_seq`, whose predicted peak fits
        (-1: none)."""
        n = len(LADDER) if max_seq is None else sum(s <= max_seq for s in LADDER)
        lo, hi = -1, n  # fits at lo, not at hi (peaks grow with the sequence)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.plan(strategy, LADDER[mid], mb, cap):
                lo = mid
            else:
                hi = mid
        return lo


def plan_for(planner: Planner, choice: dict, seq: int, mb: int):
    """The fixed Plan (`trainplan.planner.api.plan_for_choice`, STEPS steps) of a `Planner.plan` choice."""
    from trainplan.planner.api import plan_for_choice

    return plan_for_choice(MODEL, planner.hw, seq_len=seq, micro_batch=mb,
                           activation_checkpoint=tuple(choice["policies"]),
                           checkpoint_sets=choice["sets"], vocab_size=VOCAB, max_steps=STEPS,
                           loss_chunks=choice["loss_chunks"], mlp_chunks=choice["mlp_chunks"])


def describe(choice: dict) -> str:
    """The checkpoint entries of a choice and its tiling, e.g. `full+none l4 m2`."""
    text = "+".join(sorted(set(choice["policies"])))
    for key, tag in (("loss_chunks", "l"), ("mlp_chunks", "m")):
        if choice[key] > 1:
            text += f" {tag}{choice[key]}"
    return text
