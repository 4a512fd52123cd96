"""The joint plan: the planning problem, its search space, the CP-SAT models (joint and per-block),
explanations of infeasible budgets and the Pareto frontier."""
