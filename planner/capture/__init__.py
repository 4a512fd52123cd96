"""Graph capture: a model's forward+backward as op-level regions on fake tensors, and the model setup around it."""
