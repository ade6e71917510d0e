"""An OpenAI-compatible endpoint served by the rollout while it generates, so that agents written against the
OpenAI API (the ``openai`` SDK, the OpenAI Agents SDK, any HTTP client) are trained by pointing their base_url
at the run. docs/agent_server.md is the user's guide.

    config.py      rollout.agent.*: the user's agent function and the endpoint's bounds
    errors.py      OpenAI-style errors with their HTTP status
    openai_api.py  requests read and checked, responses written (chat completions, responses, models)
    rendering.py   messages and tools to token ids: whole conversations, and tails after a generated turn
    sessions.py    sessions and their branches: the token-exact record of what the model saw and produced
    server.py      the HTTP app and its server, run in the rollout's event loop
    rollout.py     the Rollout that runs the user's agent function per sample against the endpoint
"""

from hybridflow.rollout.agent_server.config import AgentServerConfig

__all__ = ["AgentServerConfig"]
