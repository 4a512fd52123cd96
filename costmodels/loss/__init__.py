"""Predicted loss: the scaling law, its fit and cache, and the penalties of lower-precision training state."""
