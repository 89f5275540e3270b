"""Training: advantages, prefix merging, losses and the trainer (DESIGN §6)."""
