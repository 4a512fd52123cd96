"""The compute governor's mathematics: learning curves, the stopping rule, its schedule and its predicted stop."""
