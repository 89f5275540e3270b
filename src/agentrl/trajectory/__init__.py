"""What samplers and trainers both need to know about a trajectory: its first messages (``prompting``), its calls
merged into training samples (``merge``) and its advantages (``advantages``). Rollout, training, evaluation and
the dashboard build on this package; it imports none of them."""
