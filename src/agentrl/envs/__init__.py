"""Task environments and generators (the built-in arithmetic task set lives in ``agentrl.envs.arith``)."""
