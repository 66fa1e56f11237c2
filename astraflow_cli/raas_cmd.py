"""`astraflow raas serve`: run a Rollout-as-a-Service node."""

from __future__ import annotations

import typer

from astraflow_cli.common import console, handle_errors, load

app = typer.Typer(help="Rollout-as-a-Service nodes.", no_args_is_help=True)


@app.command()
@handle_errors
def serve(
    ctx: typer.Context,
    experiment: str = typer.Option(..., "--experiment", "-e", help="Experiment whose tasks to serve."),
    policy: list[str] = typer.Option(..., "--policy", "-p", help="NAME=MODEL_DIR (or NAME=URL for openai); repeatable."),
    backend: str = typer.Option("torch", help="torch | vllm | openai."),
    max_inflight: int = typer.Option(8, help="Rollouts running at once; partitions pause while full."),
    max_batch: int = typer.Option(16, help="Requests decoded together (torch backend)."),
    prefetch: int = typer.Option(16, help="Tasks fetched ahead of the running rollouts (uncommitted until done)."),
    region: str = typer.Option("local", help="Region label for metrics and trajectories."),
    tasks_region: str | None = typer.Option(None, help="Read af.EXP.tasks.REGION instead of af.EXP.tasks: a region "
                                            "with its own cluster fed by MirrorMaker 2 (`astraflow kafka mirror up`)."),
    node_id: str | None = typer.Option(None, help="Default: host-pid-random."),
    follow_weights: bool = typer.Option(True, help="Apply new policy versions from the weights topics."),
    search_corpus: str | None = typer.Option(None, help="JSONL or folder of .txt for the search tool."),
    threads: int | None = typer.Option(None, help="torch CPU threads."),
    seed: int | None = typer.Option(None, help="Sampling seed (torch backend)."),
    tokenizer: str | None = typer.Option(None, help="Local tokenizer directory (openai backend)."),
    temperature: float = typer.Option(1.0, help="Temperature of the tasks served (openai backend: the server's "
                                      "logprobs are checked for it at start)."),
    top_p: float = typer.Option(1.0, help="top_p of the tasks served (openai backend: checked like --temperature)."),
    kv_cache_gib: int | None = typer.Option(None, help="vllm backend on vLLM's CPU build: KV cache size in whole GiB "
                                              "(VLLM_CPU_KVCACHE_SPACE)."),
    tool_latency: list[str] = typer.Option([], help="NAME=MEDIAN_S:SIGMA: put a tool behind a log-normal delay per "
                                           "call (benchmarks of slow remote tools), e.g. calc=0.2:1.5; repeatable."),
) -> None:
    """Join the experiment's task consumer group and serve rollouts until SIGTERM / Ctrl-C."""
    from astraflow.errors import ConfigError

    pairs = {}
    for item in policy:
        name, sep, target = item.partition("=")
        if not sep or not name or not target:
            raise ConfigError(f"--policy {item!r} must look like NAME=MODEL_DIR")
        pairs[name] = target
    from astraflow.raas.tools import parse_tool_latency

    latency = parse_tool_latency(tool_latency)
    cfg = load(ctx)
    from astraflow.raas.serve import serve_node

    console.print(f"RaaS node serving {experiment}: policies {', '.join(pairs)} on {backend}, max_inflight={max_inflight}")
    serve_node(cfg, experiment, pairs, backend=backend, max_inflight=max_inflight, max_batch=max_batch, region=region,
               prefetch=prefetch, tasks_region=tasks_region,
               node_id=node_id, follow_weights=follow_weights, search_corpus=search_corpus, threads=threads, seed=seed,
               tokenizer=tokenizer, tool_latency=latency, sampling=(temperature, top_p), kv_cache_gib=kv_cache_gib)
