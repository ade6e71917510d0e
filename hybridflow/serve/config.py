"""The training service's config (``hybridflow serve``): its sections' typed dataclasses, filled from
hybridflow/config/serve.yaml (the one place defaults are written) by the RL trainer's loader, so a --config file
and ``key=value`` overrides work as for every other command."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hybridflow.engine.config import FSDPConfig
from hybridflow.trainer.setup.config import load_config
from hybridflow.validation import require, require_choice, require_positive

SERVE_DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "config" / "serve.yaml"
DEVICES = ("cpu", "cuda")


@dataclass(kw_only=True)
class ServiceConfig:
    """Where the service listens, who may call it, and where it keeps saved weights."""

    host: str  # the address to listen on (127.0.0.1: this machine only)
    port: int  # the port (0: any free one, printed at start)
    # file of API keys, one per line, each "tml-" and 12+ characters (the SDK's rule); $HYBRIDFLOW_SERVE_API_KEYS
    # (comma-separated) adds keys; with none, the service makes one and writes it to <storage_dir>/api_key
    api_key_file: str
    storage_dir: str  # saved weights and states (tinker:// paths) live here, and survive a restart
    poll_timeout_s: float  # how long a retrieve_future call waits for its result before answering "try again"
    session_timeout_s: float  # a session without a heartbeat for this long is ended and its models freed

    def __post_init__(self) -> None:
        require(0 <= self.port < 65536, "port", f"must be in 0..65535, got {self.port}")
        require(bool(self.storage_dir), "storage_dir", "is empty", "a directory the service may write")
        require_positive(self.poll_timeout_s, "poll_timeout_s")
        require_positive(self.session_timeout_s, "session_timeout_s")


@dataclass(kw_only=True)
class LimitsConfig:
    """Bounds on what one client can ask of the shared service (a request over one is refused, naming it)."""

    max_body_bytes: int  # largest request body
    max_datums_per_request: int  # datums in one forward_backward chunk
    max_tokens_per_datum: int  # tokens of one datum or one sampling prompt (at most max_tokens_per_request)
    # tokens of all datums of one forward_backward chunk; the SDK is told a chunk's bytes so that its chunks stay
    # within it (16 bytes a token, the least a datum weighs in the SDK's estimate)
    max_tokens_per_request: int
    max_samples_per_request: int  # num_samples of one sample call
    max_samples_per_batch: int  # samples generated together (waiting requests of one sampler and settings batch up)
    max_new_tokens: int  # max_tokens of one sample call (and its default)
    max_models: int  # training models (adapters) held at once, all sessions together
    max_models_per_session: int  # training models one session may hold
    max_sessions: int  # live sessions
    max_samplers_per_session: int  # sampling sessions one session may open
    max_queued_requests: int  # requests waiting for the worker, all sessions together
    max_kept_results: int  # finished results kept for clients to fetch (the oldest fetched ones go first)

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            require_positive(value, name)
        require(
            self.max_tokens_per_datum <= self.max_tokens_per_request,
            "max_tokens_per_datum",
            f"is {self.max_tokens_per_datum}, over max_tokens_per_request ({self.max_tokens_per_request}): a datum "
            "alone in a chunk must fit in a request",
        )


@dataclass(kw_only=True)
class ServedModelConfig:
    """The base model every adapter of this service sits on."""

    path: str  # local Hugging Face directory, or a built-in name (tiny-llama, smollm2-135m-instruct; models/builtin.py)
    name: str  # the base_model name clients ask for ("": the path as given)
    max_lora_rank: int  # highest LoRA rank a client may ask for (every adapter is held at this size)
    lora_alpha: float  # an adapter of rank r is scaled by lora_alpha / r
    max_tokens_per_micro_batch: int  # padded tokens (rows x longest) per forward/backward micro-batch
    fsdp: FSDPConfig  # FSDP2's compute and gradient-reduction dtypes

    def __post_init__(self) -> None:
        require(bool(self.path), "path", "no model given", "a local Hugging Face directory or a built-in name")
        require_positive(self.max_lora_rank, "max_lora_rank")
        require_positive(self.lora_alpha, "lora_alpha")
        require_positive(self.max_tokens_per_micro_batch, "max_tokens_per_micro_batch")

    @property
    def served_name(self) -> str:
        return self.name or self.path


@dataclass(kw_only=True)
class SamplerConfig:
    """The rollout engine that serves sampling clients."""

    dtype: str  # dtype of the generation copy of the weights (auto | bf16 | fp32)


@dataclass(kw_only=True)
class ServeWorkerConfig:
    """The worker process and the Ray cluster it runs on."""

    device: str  # cpu | cuda
    cpus_per_worker: float  # CPUs reserved for the worker in the Ray placement group
    threads_per_worker: int  # torch threads of the worker (0: cpus_per_worker, at least 1)
    ray_address: str  # join this Ray cluster ("": start a local one)
    ray_num_cpus: int  # logical CPUs of a local Ray cluster (0: the machine's cores, or what the worker reserves)
    placement_timeout_s: float  # how long to wait for Ray to place the worker before failing
    seed: int  # seeds the engine (sampling seeds come with each request)

    nnodes = 1  # the service's one worker is on one node (trainer/setup/cluster.py reads it)

    def __post_init__(self) -> None:
        require(self.ray_num_cpus >= 0, "ray_num_cpus", f"must be >= 0, got {self.ray_num_cpus}")
        require_choice(self.device, DEVICES, "device")
        require_positive(self.cpus_per_worker, "cpus_per_worker")
        require(self.threads_per_worker >= 0, "threads_per_worker", f"must be >= 0, got {self.threads_per_worker}")


@dataclass(kw_only=True)
class ServeConfig:
    service: ServiceConfig  # where the service listens, who may call it, where it keeps saved weights
    limits: LimitsConfig  # bounds on what one client can ask of the shared service
    model: ServedModelConfig  # the base model every adapter sits on
    sampler: SamplerConfig  # the rollout engine that serves sampling clients
    worker: ServeWorkerConfig  # the worker process and its Ray cluster


def load_serve_config(overrides: list[str] | None = None, config_file: str | Path | None = None) -> ServeConfig:
    """serve.yaml <- ``config_file`` (if given) <- ``key=value`` overrides, as ``ServeConfig``."""
    return load_config(overrides, config_file, root=ServeConfig, defaults=SERVE_DEFAULT_CONFIG)
