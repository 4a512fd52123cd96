"""Trained weights out of trainplan: a run's checkpoint as a Hugging Face model folder with its
tokenizer (`trainplan.executor.weights.export`)."""
