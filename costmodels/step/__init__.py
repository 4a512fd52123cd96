"""Cost of one training step: memory by tensor lifetimes, the per-op roofline, collectives, FSDP2 and Ulysses."""
