"""The torch side of a plan's model, shared by planner and executor: presets built from HF configs,
the LM loss, saved-activation compression and the FLOP-counting convention."""
