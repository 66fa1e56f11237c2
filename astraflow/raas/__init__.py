"""Rollout-as-a-Service: nodes that pull tasks, run agent workflows on inference backends, and
publish trajectories; they follow their policies' weights topics while they serve."""
