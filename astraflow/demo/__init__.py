"""`astraflow demo`: the whole pipeline on one machine, learning a tool-using agent on CPU."""
