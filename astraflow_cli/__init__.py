"""The `astraflow` command line. Heavy libraries (torch, transformers, faust) are imported inside
the commands that need them, so `astraflow --help` answers instantly."""
