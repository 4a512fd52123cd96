"""Training data: the corpus and its tokenizer, the micro-batch sampler, and data-subset selection
(static, and during a run)."""
