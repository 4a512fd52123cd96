"""Cost models: pure functions of a captured graph x a hardware profile x a choice of knobs.

- `costmodels.step`: memory, FLOPs and time of one training step (the per-op roofline, the
  tensor-lifetime simulation, ZeRO/FSDP2, Ulysses SP, collectives, the exact cost of a
  checkpoint set);
- `costmodels.loss`: the predicted loss (a Chinchilla-form law with data-constrained
  repetition, its fit) and the loss penalties of lower-precision training state;
- `costmodels.data`: what a selected data subset is worth and what scoring it costs;
- `costmodels.stopping`: the compute governor's learning-curve fit, stopping rule and schedule,
  and the stop the planner predicts from a curve;
- `costmodels.graph`, `costmodels.checkpoint_sets`: the captured graph's types and the
  activation-checkpoint menu; `costmodels.checks`: scalar input checks.

No solver, no torch model, no planner or executor (the import-linter contract in
pyproject.toml): solvers live in `planner`, which imports these. The only disk access is the
small JSON caches of fitted constants, `costmodels.loss.cache` and
`costmodels.data.quality_cache`. Each module is imported from its own path; this package
re-exports nothing.
"""
