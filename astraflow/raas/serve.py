"""Process wiring of a RaaS node: build backends, follow weights, handle signals, run the loop."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from astraflow.config import AstraflowConfig
from astraflow.kafka.acl import role_topics
from astraflow.kafka.topics import TopicAdmin, create_command
from astraflow.raas.backends import create_backend
from astraflow.raas.node import NodeSettings, RaasNode
from astraflow.raas.tools import default_tools

log = logging.getLogger("astraflow.raas")


def serve_node(cfg: AstraflowConfig, experiment: str, policies: dict[str, str], *, backend: str = "torch",
               max_inflight: int = 8, max_batch: int = 16, region: str = "local", node_id: str | None = None,
               prefetch: int = 16, tasks_region: str | None = None,
               follow_weights: bool = True, search_corpus: str | None = None, threads: int | None = None,
               seed: int | None = None, tokenizer: str | None = None,
               tool_latency: dict[str, tuple[float, float]] | None = None,
               sampling: tuple[float, float] = (1.0, 1.0), kv_cache_gib: int | None = None) -> None:
    """`sampling`: (temperature, top_p) of the tasks served, checked against an openai server's logprobs."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log.info("node starting (modules imported)")  # the start-up's parts are timed from these lines
    # The operator creates the topics (`astraflow topics create`); checked before loading any model.
    needed = role_topics("raas", experiment, list(policies))
    if tasks_region:
        from astraflow.kafka.topics import Topics

        t = Topics(experiment)
        needed = [t.tasks_of(tasks_region) if n == t.tasks else n for n in needed]
    TopicAdmin(cfg.kafka).require(needed, create_command(experiment, list(policies)))
    opts: dict[str, Any] = {}
    started: dict[str, Any] = {}
    if backend == "torch":
        # The engine in its own process: workflows, serde and Kafka never hold its interpreter lock.
        # Started first, before this process imports torch: the child's imports and model load
        # (the longest part of a start) run meanwhile instead of after.
        from astraflow.raas.backends.engine_spawn import engine_args, start_engine

        started = {name: start_engine(engine_args(target, max_batch=max_batch, threads=threads, seed=seed))
                   for name, target in policies.items()}
        opts = {"max_batch": max_batch, "threads": threads, "seed": seed, "process": True,
                "engine_restarts": cfg.raas.engine_restarts}
    elif backend == "openai":
        opts = {"tokenizer": tokenizer, "temperature": sampling[0], "top_p": sampling[1]}
    elif backend == "vllm":
        opts = {"seed": seed, "kv_cache_gib": kv_cache_gib, "engine_restarts": cfg.raas.engine_restarts}
    # the weights are fetched while the model is built (over a WAN a snapshot takes seconds)
    readers = prefetch_followers(cfg, experiment, list(policies)) if follow_weights and backend != "openai" else {}
    try:
        backends = {name: create_backend(backend, name, target, **opts, **({"started": started.pop(name)} if name in started else {}))
                    for name, target in policies.items()}
    except BaseException:
        for r in readers.values():
            r.close()
        for s in started.values():  # not adopted by a backend
            s.close()
        raise
    log.info("backends built: %s", ", ".join(backends))
    followers: list = []
    prometheus = None
    try:
        if follow_weights and backend == "openai":
            log.info("openai backend: the server manages its weights; not following the weights topics")
        elif follow_weights:
            followers = start_followers(cfg, experiment, backends, readers)
            if followers:  # join the tasks group only with the newest weights (raas.catch_up_timeout_s)
                from astraflow.raas.weight_follower import wait_caught_up

                wait_caught_up(cfg, experiment, backends, cfg.raas.catch_up_timeout_s)
        kw = {"node_id": node_id} if node_id else {}
        settings = NodeSettings(experiment, max_inflight=max_inflight, region=region, prefetch=prefetch,
                                tasks_region=tasks_region, **kw)
        node = RaasNode(cfg, settings, backends, default_tools(search_corpus, tool_latency, seed))
        prometheus = _prometheus(experiment, node)

        async def main() -> None:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, node.stop)
            await node.run()

        _run_until_stopped(main)
    finally:
        if prometheus is not None:
            prometheus.close()
        for f in followers:
            f.stop()
        for b in backends.values():
            b.close()
    log.info("node %s stopped after %d rollouts", settings.node_id, node.rollouts_done)


def _run_until_stopped(main, grace_s: float = 5.0) -> None:
    """`asyncio.run`, except that rollouts still running when the node stops (a workflow that
    ignored its cancellation at the deadline) get `grace_s` to end instead of holding the exit."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(main())
    finally:
        leftovers = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in leftovers:
            t.cancel()
        if leftovers:
            loop.run_until_complete(asyncio.wait(leftovers, timeout=grace_s))
            stuck = [t for t in leftovers if not t.done()]
            if stuck:
                log.warning("%d abandoned rollouts did not end within %.0f s of the stop; exiting anyway",
                            len(stuck), grace_s)
        loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)
        loop.close()


def _prometheus(experiment: str, node: RaasNode):
    """Opt-in /metrics endpoint (ASTRAFLOW_METRICS_PORT) serving the node's latest metrics."""
    from astraflow.metrics_export import serve_role

    endpoint = serve_role(experiment, "raas", node.node.node_id)
    if endpoint is not None:
        node.metric_observers.append(endpoint.observe)
    return endpoint


def prefetch_followers(cfg: AstraflowConfig, experiment: str, policies: list[str]) -> dict:
    """Weight readers positioned at each policy's newest snapshot, fetching while the model is built."""
    try:
        from astraflow.raas.weight_follower import prefetch_weights
    except ImportError:
        return {}
    return prefetch_weights(cfg, experiment, policies)


def start_followers(cfg: AstraflowConfig, experiment: str, backends: dict, readers: dict | None = None) -> list:
    """Starts one weight follower per policy (on `readers` from `prefetch_followers`, when given);
    returns objects with `stop()` (empty until available)."""
    try:
        from astraflow.raas.weight_follower import start_weight_followers
    except ImportError:
        log.warning("weight following unavailable in this build; serving initial weights only")
        return []
    return start_weight_followers(cfg, experiment, backends, readers)
