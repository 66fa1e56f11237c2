"""Operating a running experiment from the outside: offsets and lag, status reports, their rendering.

Everything here only reads topics and group offsets; it never joins a consumer group and never
commits, so watching an experiment cannot change what its components do.
"""
