"""Stream apps: workers that wire the pure strategies of `astraflow.dataflow` to topics.

`reward`, `curate`, `curator` (one module each), the runner of user processors (`process`),
and the archive app. They share `runtime.StreamWorker` (consume -> handle -> produce -> commit,
DLQ, metrics, control) and are started with `astraflow app run NAME` / `astraflow process run`,
or in-process through `stream_apps.launch`. Importing this package imports nothing heavy.
"""
