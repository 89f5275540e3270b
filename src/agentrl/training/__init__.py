"""Training: micro-batches and shared-prefix forwarding, logprobs, losses, the trainer, checkpoints and publishing
(docs/training.md, docs/architecture.md). Advantages and the merge of a trajectory's calls live in
``agentrl.trajectory``."""
