"""An OpenAI-compatible endpoint served by the rollout while it generates, so that agents written against the
OpenAI API (the ``openai`` SDK, the OpenAI Agents SDK, any HTTP client) are trained by pointing their base_url
at the run, and verifiers environments (their own client renders token ids) are run against it.
docs/agent_server.md and docs/environments.md are the user's guides.

    config.py      rollout.agent.*: the user's agent function and the endpoint's bounds
    errors.py      OpenAI-style errors with their HTTP status
    openai_api.py  OpenAI requests read and checked (chat completions, responses)
    openai_messages.py  their messages and tools, checked and normalised
    openai_replies.py   replies written (chat completions whole or streamed, responses, models)
    generate_api.py  the token route's requests and replies (/inference/v1/generate: ids in, ids out)
    rendering.py   messages and tools to token ids: whole conversations, and tails after a generated turn
    sessions.py    sessions and their branches: the token-exact record of what the model saw and produced
    server.py      the HTTP app and its server, run in the rollout's event loop
    rollout.py     the Rollout that runs the user's agent function per sample against the endpoint
    environment_runner.py  the verifiers runner of a rollout (a process in the environment's own venv)
"""

from hybridflow.rollout.agent_server.config import AgentServerConfig

__all__ = ["AgentServerConfig"]
