"""Stream apps: Faust apps that wire the pure strategies of `astraflow.dataflow` to topics.

`reward`, `curate`, `curator` (one module each) and the runner of user processors (`process`)
are handlers run by `engine.StreamEngine`, which builds one Faust app per worker
(`faust_app`: agent, changelog-backed tables, timers; `transactions`: exactly-once on Kafka
transactions; `codec`: single-object Avro for Faust). They are started with
`astraflow app run NAME` / `astraflow process run`, Faust's own `faust -A
stream_apps.faust_worker worker`, or in-process through `stream_apps.launch`. The archive app
(`archive`) is a plain consumer loop (see its module doc). Importing this package imports
nothing heavy.
"""
