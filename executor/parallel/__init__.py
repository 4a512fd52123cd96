"""Parallel training: Ulysses sequence parallelism, ZeRO stages over DDP and FSDP2, collectives and process launch."""
