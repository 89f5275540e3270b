"""Rollouts: the sampler processes that turn Tasks into scored, token-exact trajectories (docs/sampling.md).

A sampler (:mod:`~agentrl.rollout.sampler`, assembled by :mod:`~agentrl.rollout.process` from
:mod:`~agentrl.rollout.config`) claims Task slots from the store, runs each trajectory — multi-turn tool calls
(:mod:`~agentrl.rollout.agent`, kept as tokens by :mod:`~agentrl.rollout.conversation`) or an environment episode
(:mod:`~agentrl.rollout.episode`) — against the inference services (:mod:`~agentrl.rollout.inference_pool`), scores
it, and once a Task's group is complete decides what is trained (:mod:`~agentrl.rollout.group_stage`). Which Tasks
come next is the curriculum's (:mod:`~agentrl.rollout.curriculum`). Modules are imported where used: this package
imports nothing itself.
"""
