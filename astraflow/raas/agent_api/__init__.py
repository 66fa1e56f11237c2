"""An OpenAI-compatible endpoint per rollout, so agents written for the OpenAI API train unchanged.

`server.AgentEndpoint` listens on 127.0.0.1 for the node; `RolloutContext.openai_endpoint()`
gives a workflow a base URL and a key scoped to its rollout; `session.AgentSession` serves and
records each call; `protocol` checks requests; `render` is the chat format (the model's chat
template, else the project's own). See docs/raas.md.
"""

from astraflow.raas.agent_api.protocol import ApiError
from astraflow.raas.agent_api.server import AgentEndpoint, EndpointAccess

__all__ = ["AgentEndpoint", "ApiError", "EndpointAccess"]
