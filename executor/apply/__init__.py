"""A Plan applied to the user's own model and training loop: `executor.apply.applied.apply_plan`
(also `executor.apply_plan`), the checkpoint sets with their op check (`executor.apply.checkpointing`)
and the measurements a user's loop records for trainplan's report (`executor.apply.measuring`)."""
