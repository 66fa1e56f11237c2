"""Example user processors (see docs/processors.md); run one with `astraflow process run`."""
