"""The node's OpenAI-compatible HTTP endpoint: one listener, one key per rollout.

    async with ctx.openai_endpoint() as access:     # inside a workflow
        run_my_agent(base_url=access.base_url, api_key=access.api_key, model=access.model)

The listener binds 127.0.0.1 on a port the OS picks, when the first rollout asks for it. Each
rollout gets a fresh random key (256 bits) valid while its `async with` lasts; the key selects
the rollout, so an agent can only reach its own trajectory. Served: `POST /v1/chat/completions`,
`POST /v1/completions` (both with `stream` as server-sent events: the whole completion in one
chunk, then `[DONE]`) and `GET /v1/models`. Whatever a request holds (no key, a wrong one, a
body that is not JSON, over `MAX_BODY_BYTES`, fields out of range), the answer is an
OpenAI-style error naming what was wrong, and the node goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from astraflow.config import RaasSettings
from astraflow.raas.agent_api.protocol import ApiError, Limits, parse_chat, parse_completion, parse_json
from astraflow.raas.agent_api.session import AgentSession
from astraflow.raas.workflows.base import RolloutContext

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger("astraflow.raas.agent_api")

MAX_BODY_BYTES = 4 * 1024 * 1024  # largest request body read


@dataclass(frozen=True, slots=True)
class EndpointAccess:
    """What an agent program needs: give these to an OpenAI client (or export them as the
    `OPENAI_BASE_URL`, `OPENAI_API_KEY` environment variables of an agent process)."""

    base_url: str  # http://127.0.0.1:PORT/v1
    api_key: str  # this rollout's key
    model: str  # the rollout's first policy (what `model` should name)

    def env(self) -> dict[str, str]:
        """Environment variables for an agent process (OpenAI SDKs read the first two)."""
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.api_key, "OPENAI_MODEL": self.model}


class AgentEndpoint:
    """The listener and the open rollouts' sessions of one node."""

    def __init__(self, limits: RaasSettings | None = None, host: str = "127.0.0.1") -> None:
        self.raas = limits or RaasSettings()
        self.host = host
        self.port: int | None = None
        self.requests = 0  # requests answered (errors included)
        self.refused = 0  # requests answered with an error
        self._sessions: dict[str, AgentSession] = {}
        self._runner: web.AppRunner | None = None  # aiohttp is imported when the listener starts
        self._starting = asyncio.Lock()

    async def start(self) -> None:
        async with self._starting:
            if self._runner is not None:
                return
            from aiohttp import web

            app = web.Application(client_max_size=MAX_BODY_BYTES)
            app.router.add_post("/v1/chat/completions", self._chat)
            app.router.add_post("/v1/completions", self._completions)
            app.router.add_get("/v1/models", self._models)
            runner = web.AppRunner(app, access_log=None, handle_signals=False)
            await runner.setup()
            site = web.TCPSite(runner, self.host, 0)
            await site.start()
            self.port = runner.addresses[0][1]
            self._runner = runner
            log.info("OpenAI-compatible endpoint on http://%s:%d/v1", self.host, self.port)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @contextlib.asynccontextmanager
    async def open(self, ctx: RolloutContext) -> AsyncIterator[EndpointAccess]:
        """A key scoped to `ctx`'s rollout, valid until the block exits."""
        await self.start()
        key = "af-" + secrets.token_urlsafe(32)
        p = ctx.task.sampling
        limits = Limits(min(p.max_tokens, self.raas.max_tokens), self.raas.max_prompt_chars,
                        self.raas.max_stop_strings, self.raas.max_stop_chars)
        session = AgentSession(ctx, limits, key)
        self._sessions[key] = session
        try:
            yield EndpointAccess(f"http://{self.host}:{self.port}/v1", key, ctx.task.policies[0])
        finally:
            self._sessions.pop(key, None)
            session.close()

    # ---- handlers ------------------------------------------------------------------------------

    def _session(self, request: web.Request) -> AgentSession:
        auth = request.headers.get("Authorization", "")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise ApiError("missing API key: send 'Authorization: Bearer <key>' with the key of your rollout",
                           status=401, type="authentication_error")
        for known, session in list(self._sessions.items()):
            if hmac.compare_digest(known.encode(), key.strip().encode()):
                return session
        raise ApiError("this API key is not valid (wrong key, or its rollout has ended)", status=401,
                       type="authentication_error")

    async def _handle(self, request: web.Request, kind: str) -> web.StreamResponse:
        from aiohttp import web

        self.requests += 1
        try:
            session = self._session(request)
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise ApiError(f"the request body is over {MAX_BODY_BYTES} bytes", status=413) from None
            body = parse_json(raw)
            if kind == "chat":
                req = parse_chat(body, session.limits)
                result, stream = await session.chat(req), req.sampling.stream
            else:
                req2 = parse_completion(body, session.limits)
                result, stream = await session.complete(req2), req2.sampling.stream
        except ApiError as exc:
            self.refused += 1
            return web.json_response(exc.body(), status=exc.status)
        except Exception as exc:  # a backend failure: the agent gets a 500 with the reason, the node goes on
            self.refused += 1
            log.exception("endpoint request failed")
            err = ApiError(f"the model call failed: {type(exc).__name__}: {str(exc)[:300]}", status=500,
                           type="server_error")
            return web.json_response(err.body(), status=500)
        if not stream:
            return web.json_response(result)
        return await self._sse(request, result)

    async def _sse(self, request: web.Request, result: dict[str, Any]) -> web.StreamResponse:
        from aiohttp import web

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        choice = dict(result["choices"][0])
        if result["object"] == "chat.completion":
            message = choice.pop("message")
            chunk = {**result, "object": "chat.completion.chunk", "choices": [{**choice, "delta": message}]}
        else:
            chunk = result
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "chat")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "completion")

    async def _models(self, request: web.Request) -> web.Response:
        from aiohttp import web

        try:
            session = self._session(request)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        return web.json_response({"object": "list", "data": [
            {"id": p, "object": "model", "owned_by": "astraflow"} for p in session.ctx.task.policies]})


__all__ = ["MAX_BODY_BYTES", "AgentEndpoint", "EndpointAccess"]
