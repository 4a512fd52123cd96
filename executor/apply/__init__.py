"""A Plan applied to the user's own model and training loop: `trainplan.executor.apply.applied.apply_plan`
(also `trainplan.executor.apply_plan`), the checkpoint sets with their op check
(`trainplan.executor.apply.checkpointing`)
and the measurements a user's loop records for trainplan's report (`trainplan.executor.apply.measuring`)."""
