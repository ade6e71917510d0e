"""The agent endpoint's settings (``actor_rollout_ref.rollout.agent.*``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hybridflow.validation import require, require_positive


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

    def __post_init__(self) -> None:
        require(
            self.function == "" or ":" in self.function,
            "function",
            f"{self.function!r} is not file.py:function or module:function",
        )
        require(
            not (self.external and self.function), "external", "agents are either a function or external", "set one"
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
        return bool(self.function) or self.external
