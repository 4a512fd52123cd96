"""Cost models: pure functions of a captured graph x a hardware profile x a choice of knobs.

- `trainplan.costmodels.step`: memory, FLOPs and time of one training step (the per-op roofline, the
  tensor-lifetime simulation, ZeRO/FSDP2, Ulysses SP, collectives, the exact cost of a
  checkpoint set);
- `trainplan.costmodels.loss`: the predicted loss (a Chinchilla-form law with data-constrained
  repetition, its fit) and the loss penalties of lower-precision training state;
- `trainplan.costmodels.data`: what a selected data subset is worth and what scoring it costs;
- `trainplan.costmodels.stopping`: the compute governor's learning-curve fit, stopping rule and schedule,
  and the stop the planner predicts from a curve;
- `trainplan.costmodels.graph`, `trainplan.costmodels.checkpoint_sets`: the captured graph's types and the
  activation-checkpoint menu; `trainplan.costmodels.checks`: scalar input checks.

No solver, no torch model, no planner or executor (the import-linter contract in
pyproject.toml): solvers live in `planner`, which imports these. The only disk access is the
small JSON caches of fitted constants, `trainplan.costmodels.loss.cache` and
`trainplan.costmodels.data.quality_cache`. Each module is imported from its own path; this package
re-exports nothing.
"""
