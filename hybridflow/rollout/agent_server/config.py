"""The agent endpoint's settings (``actor_rollout_ref.rollout.agent.*``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.validation import require, require_positive


@dataclass(kw_only=True)
class VerifiersConfig:
    """A verifiers environment whose episodes are the samples (docs/environments.md)."""

    # the environment's taskset id: an importable module (verifiers' own, one installed in its venv, or a file under
    # `path`) whose __all__ names one vf.Taskset, and optionally a vf.Env; "": no environment
    env: str
    # more of the environment's config, merged over {"taskset": {"id": env}, "agent": {"harness": {"id":
    # "hybridflow-chat"}, "runtime": {"type": "subprocess"}}}: taskset settings, timeouts, the seat's harness
    args: dict[str, Any]
    path: str  # a directory put first on the environment's PYTHONPATH (where its module is); "": none
    # the Python of the environment's venv (verifiers pins an openai older than the run's); "":
    # $HYBRIDFLOW_VERIFIERS_PYTHON, else the venv `make verifiers-env` builds (.venv-verifiers)
    python: str
    # how verifiers' client renders conversations to token ids: a renderers config, {name: default} (the tokenizer's
    # chat template, re-rendered each turn) or one whose turns extend token for token, e.g. {name: qwen3}
    renderer: dict[str, Any]

    def __post_init__(self) -> None:
        require(isinstance(self.args, dict), "args", "must be a mapping of the environment's config keys")
        require("name" in self.renderer, "renderer", "needs a name (default, qwen3, ...)")
        if self.path:
            self.path = str(Path(self.path).expanduser().resolve())
        if self.python:
            self.python = str(Path(self.python).expanduser().absolute())  # not resolved: a venv's python is a link


@dataclass(kw_only=True)
class AgentServerConfig:
    # the user's agent, file.py:function or module:function, called for each sample with the endpoint's base_url,
    # api_key and the data row; it returns the reward (or a dict with "reward" and more metrics). "": no agent
    function: str
    # agents in other processes, containers or languages claim the samples' sessions (POST /v1/sessions/claim with
    # the run's key), talk to the endpoint and post their rewards; needs endpoint_dir (docs/agent_server.md)
    external: bool
    # where each generating rank writes its endpoint's address and run key while it serves (rank<r>.json, readable
    # by the user only), for external agents; "": not written
    endpoint_dir: str
    host: str  # the address the endpoint listens on: loopback unless the agents run on another machine
    port: int  # 0: a free port, chosen per generation call
    model_name: str  # the model id the endpoint serves (what agents pass as `model`)
    timeout_s: float  # an agent still running after this long fails (its sample leaves the update)
    # the longest rendered conversation a request may bring before generation (also the prompt columns of the batch)
    max_prompt_tokens: int
    max_body_bytes: int  # a request body larger than this is refused (413)
    max_sessions: int  # sessions open at once; a request for another is refused (429)
    max_requests_per_session: int  # requests one session may make (429 after)
    max_requests_per_second: float  # per session, averaged over a burst of that many requests (429 above)
    max_branches_per_session: int  # conversations a session may start (a history the client edited starts one)
    # the sessions' first turns wait for each other until all are in or none arrives for this long, so that the
    # engine prefills them together
    first_turn_window_s: float
    verifiers: VerifiersConfig  # a verifiers environment's episodes as the agents (their sessions are external)

    def __post_init__(self) -> None:
        require(
            self.function == "" or ":" in self.function,
            "function",
            f"{self.function!r} is not file.py:function or module:function",
        )
        require(
            not (self.external and self.function), "external", "agents are either a function or external", "set one"
        )
        require(
            not (self.verifiers.env and (self.function or self.external)),
            "verifiers.env",
            "a run's agents are a function, external agents or a verifiers environment",
            "set one",
        )
        require(not self.external or bool(self.endpoint_dir), "endpoint_dir", "external agents find the endpoint there")
        require(0 <= self.port < 65536, "port", f"must be in [0, 65535], got {self.port}")
        require(bool(self.model_name), "model_name", "must not be empty")
        for name in ("timeout_s", "max_prompt_tokens", "max_body_bytes", "max_sessions"):
            require_positive(getattr(self, name), name)
        require(self.first_turn_window_s >= 0, "first_turn_window_s", "must be >= 0")
        for name in ("max_requests_per_session", "max_requests_per_second", "max_branches_per_session"):
            require_positive(getattr(self, name), name)
        file, _, name = self.function.rpartition(":")
        if file.endswith(".py"):  # as the driver sees it: the workers may start elsewhere
            self.function = f"{Path(file).expanduser().resolve()}:{name}"
        if self.endpoint_dir:
            self.endpoint_dir = str(Path(self.endpoint_dir).expanduser().resolve())

    @property
    def enabled(self) -> bool:
        return bool(self.function) or self.external_sessions

    @property
    def external_sessions(self) -> bool:
        """Whether sessions wait to be claimed (by external agents or the verifiers runner)."""
        return self.external or bool(self.verifiers.env)
