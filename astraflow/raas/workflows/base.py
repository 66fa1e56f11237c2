"""What a workflow receives and how it builds its Trajectory.

A workflow is `async def wf(ctx: RolloutContext) -> Trajectory`. It calls the policies'
backends through `ctx.generate(policy, ...)`, which appends a trained segment, and adds context
it did not sample (prompt, tool results) with `ctx.add_context(...)`, which is masked out of the
loss. Each policy has its own context: its segments, cut into sequences at its `prompt`
segments (`astraflow.dataflow.sequences`); a workflow with several policies passes one's
output to another as text. `ctx.finish(...)` returns the Trajectory. `ctx.openai_endpoint()` hands an agent program an
OpenAI-compatible base URL and key whose calls are recorded the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from astraflow.dataflow.sequences import segment_sequences
from astraflow.errors import ConfigError
from astraflow.raas.backends.base import GenerateRequest, Generation, InferenceBackend
from astraflow.raas.tools import ToolBox
from astraflow.records import NodeInfo, Segment, Task, Timings, ToolCall, Trajectory, TrajectoryStatus, now_ms

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager

    from astraflow.raas.agent_api.server import AgentEndpoint, EndpointAccess


@dataclass
class RolloutContext:
    """One sample of one task: inputs, backends, tools, and the trajectory being built."""

    task: Task
    sample_index: int
    backends: dict[str, InferenceBackend]  # policy name -> backend
    tools: ToolBox
    node: NodeInfo
    segments: list[Segment] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    started_at: int = field(default_factory=now_ms)
    generate_s: float = 0.0
    tool_s: float = 0.0
    agent_api: AgentEndpoint | None = None  # the node's OpenAI-compatible endpoint

    def openai_endpoint(self) -> AbstractAsyncContextManager[EndpointAccess]:
        """`async with ctx.openai_endpoint() as access:` a base URL and key scoped to this rollout;
        an agent's calls through them are recorded in this trajectory (`astraflow.raas.agent_api`)."""
        if self.agent_api is None:
            raise ConfigError("this rollout has no OpenAI endpoint: a RaasNode gives every rollout one; "
                              "elsewhere pass RolloutContext(..., agent_api=AgentEndpoint())")
        return self.agent_api.open(self)

    def backend(self, policy: str) -> InferenceBackend:
        try:
            return self.backends[policy]
        except KeyError:
            raise KeyError(f"task {self.task.task_id} needs policy {policy!r}, not served by this node") from None

    def add_context(self, policy: str, role: str, text: str, *, add_bos: bool = False) -> list[int]:
        """Appends tokens the policy did not generate (masked out of the loss); returns their ids."""
        ids = self.backend(policy).encode(text, add_bos=add_bos)
        self.segments.append(Segment.context(policy, role, ids, text))
        return ids

    def context_ids(self, policy: str) -> list[int]:
        """The policy's next prompt: its current sequence (`policy_sequences(..)[-1]`), exactly what it
        is trained on. Other policies' tokens are not in it: a workflow hands a policy another's
        output as text, with `add_context` (each policy has its own tokenizer)."""
        seqs = segment_sequences(self.segments, policy)
        return [int(t) for s in (seqs[-1] if seqs else []) for t in s.token_ids]

    async def generate(self, policy: str, *, stop: list[str] | None = None, max_tokens: int | None = None,
                       prompt_ids: list[int] | None = None) -> Generation:
        """Samples a continuation of the context from `policy` and appends it as a trained segment."""
        p = self.task.sampling
        req = GenerateRequest(
            prompt_ids if prompt_ids is not None else self.context_ids(policy),
            max_tokens or p.max_tokens,
            p.temperature,
            p.top_p,
            list(stop if stop is not None else p.stop),
        )
        t0 = time.perf_counter()
        gen = await self.backend(policy).generate(req)
        self.generate_s += time.perf_counter() - t0
        self.segments.append(Segment(policy, "assistant", gen.token_ids, gen.logprobs,
                                     np.ones(len(gen.token_ids), np.uint8), gen.versions, gen.text))
        return gen

    async def call_tool(self, name: str, args: str, turn: int) -> ToolCall:
        call = await self.tools.call(name, args, turn)
        self.tool_s += call.latency_s
        self.tool_calls.append(call)
        return call

    def finish(self, final_answer: str | None, status: TrajectoryStatus = TrajectoryStatus.OK,
               error: str | None = None, metadata: dict[str, str] | None = None) -> Trajectory:
        t = self.task
        return Trajectory(
            trajectory_id=Trajectory.make_id(t.task_id, self.sample_index),
            task_id=t.task_id,
            group_id=t.group_id,
            prompt_id=t.prompt_id,
            dataset=t.dataset,
            workflow=t.workflow,
            sample_index=self.sample_index,
            group_size=t.n_samples,
            segments=self.segments,
            timings=Timings(t.created_at, self.started_at, now_ms(), self.generate_s, self.tool_s),
            node=self.node,
            tool_calls=self.tool_calls,
            final_answer=final_answer,
            reference=t.reference,
            status=status,
            error=error,
            lineage=list(t.lineage),
            metadata={**t.metadata, **(metadata or {})},
            temperature=t.sampling.temperature,
        )

