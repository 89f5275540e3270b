"""AutoRL-Bench: scenarios (base model, training data, hidden test data, evaluation protocol), the benchmark
server speaking both of the seeds' APIs (scenario API and grading API), and the run orchestrator that hands a
scenario to an agent and grades what it submits. Evaluations run through ``agentrl eval``."""
