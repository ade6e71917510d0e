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

    def __post_init__(self) -> None:
        require(
            self.function == "" or ":" in self.function,
            "function",
            f"{self.function!r} is not file.py:function or module:function",
        )
        require(0 <= self.port < 65536, "port", f"must be in [0, 65535], got {self.port}")
        require(bool(self.model_name), "model_name", "must not be empty")
        for name in ("timeout_s", "max_prompt_tokens", "max_body_bytes", "max_sessions"):
            require_positive(getattr(self, name), name)
        for name in ("max_requests_per_session", "max_requests_per_second", "max_branches_per_session"):
            require_positive(getattr(self, name), name)
        file, _, name = self.function.rpartition(":")
        if file.endswith(".py"):  # as the driver sees it: the workers may start elsewhere
            self.function = f"{Path(file).expanduser().resolve()}:{name}"

    @property
    def enabled(self) -> bool:
        return bool(self.function)
