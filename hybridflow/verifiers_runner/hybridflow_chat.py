"""A verifiers harness that runs its chat loop in the runner's own process (harness id ``hybridflow-chat``).

verifiers' built-in harnesses run a program of their own (a PEP 723 script that ``uv`` installs from PyPI on first
use); this one needs nothing beyond the runner's venv. Each call sends the conversation to the episode's
interception endpoint, as verifiers' contract for harnesses asks (every model call goes through ``endpoint`` with
``secret``), and returns the reply's text. It has no tools (MCP): environments with tools name a harness that
supports them. A multi-turn environment resumes it on the grown conversation.
"""

import asyncio

import httpx
import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.dialects.chat import message_to_wire

_HTTP: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}


def _http() -> httpx.AsyncClient:
    """One HTTP client for every launch in this event loop: building one (its TLS context) costs about 50 ms of CPU,
    more than a short episode's own work."""
    loop = asyncio.get_running_loop()
    if loop not in _HTTP:
        _HTTP[loop] = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0))
    return _HTTP[loop]


class HybridflowChatConfig(vf.HarnessConfig):
    pass


class HybridflowChat(vf.Harness[HybridflowChatConfig]):
    APPENDS_SYSTEM_PROMPT = True  # the task's system prompt is sent as a system message
    SUPPORTS_RESUME = True  # verifiers' default resume() relaunches on the grown conversation
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [message_to_wire(message) for message in prompt or []]
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=2, http_client=_http())
        reply = await client.chat.completions.create(model=ctx.model, messages=messages)
        return vf.ProgramResult(exit_code=0, stdout=reply.choices[0].message.content or "", stderr="")


__all__ = ["HybridflowChat"]
