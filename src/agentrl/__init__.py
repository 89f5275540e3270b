"""AgentRL: decoupled, asynchronous reinforcement learning for multi-turn tool-using LLM agents."""

__version__ = "0.1.0"
