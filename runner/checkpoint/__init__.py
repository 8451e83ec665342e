"""Checkpoints: a run's sharded weights, optimizer state, RNG and sample order written and read
back."""
