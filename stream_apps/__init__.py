"""Faust stream processors that wire the pure strategies of `astraflow.dataflow` to topics."""
