"""Environments in the AgentBench families, for agents that speak the OpenAI API.

`database` (SQL over a per-rollout SQLite database), `shell` (an operating-system task in the
sandbox, checked by a script), `programming` (a function that must pass hidden unit tests, scored
by the `code_tests` reward), each with a small generated dataset (`datasets`). Their workflows
(`db_agent`, `os_agent`, `code_agent`) live in `astraflow.raas.workflows.envs`.
"""
