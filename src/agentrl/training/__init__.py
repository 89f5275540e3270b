"""Training: advantages, prefix merging, losses and the trainer (docs/architecture.md)."""
