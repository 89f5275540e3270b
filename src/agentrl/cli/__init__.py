"""Command-line entry points (`agentrl ...`). Nothing in the package imports this sub-package."""
