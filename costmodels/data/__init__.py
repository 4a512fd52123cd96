"""What a data subset is worth: the selection-quality multiplier, its fit and cache, and what scoring a corpus costs."""
