"""The Tinker API's JSON requests as the service reads them: only the fields it uses, with their types and bounds
checked by pydantic (a body that fails is answered 400 with pydantic's account of it). Fields a newer SDK adds
are ignored, so a client a version ahead still works where it asks nothing new."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Request(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class CreateSession(Request):
    tags: list[str] = Field(default_factory=list, max_length=64)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = Field("", max_length=64)
    display_name: str | None = Field(None, max_length=256)


class SessionRef(Request):
    session_id: str = Field(max_length=128)


class LoraSettings(Request):
    rank: int = Field(ge=1)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerSettings(Request):
    type: str = "adamw"


class CreateModel(Request):
    session_id: str = Field(max_length=128)
    model_seq_id: int = Field(ge=0, lt=10**9)
    base_model: str = Field(max_length=512)
    lora_config: LoraSettings | None = None
    optimizer_config: OptimizerSettings = Field(default_factory=OptimizerSettings)


class ModelRef(Request):
    model_id: str = Field(max_length=128)


class AdamSettings(Request):
    learning_rate: float = Field(1e-4, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip_norm: float = Field(0.0, ge=0)
    type: str | None = None


class OptimStep(Request):
    adam_params: AdamSettings | None = None
    optimizer_params: dict[str, Any] | None = None
    model_id: str = Field(max_length=128)
    seq_id: int = Field(ge=1)


class SaveWeights(Request):
    model_id: str = Field(max_length=128)
    path: str | None = Field(None, max_length=256)
    seq_id: int = Field(ge=1)
    overwrite: bool = False


class SaveWeightsForSampler(Request):
    model_id: str = Field(max_length=128)
    path: str | None = Field(None, max_length=256)
    sampling_session_seq_id: int | None = Field(None, ge=0, lt=10**9)
    kind: str = "snapshot"
    seq_id: int = Field(ge=1)


class LoadWeights(Request):
    model_id: str | None = Field(None, max_length=128)
    seq_id: int | None = Field(None, ge=0)
    session_id: str | None = Field(None, max_length=128)
    model_seq_id: int | None = Field(None, ge=0, lt=10**9)
    base_model: str | None = Field(None, max_length=512)
    path: str = Field(max_length=1024)
    optimizer: bool
    optimizer_config: OptimizerSettings | None = None


class CreateSamplingSession(Request):
    session_id: str = Field(max_length=128)
    sampling_session_seq_id: int = Field(ge=0, lt=10**9)
    base_model: str | None = Field(None, max_length=512)
    model_path: str | None = Field(None, max_length=1024)


class Chunk(Request):
    type: str = "encoded_text"
    tokens: list[int] | None = None


class ModelInput(Request):
    chunks: list[Chunk]


class SamplingSettings(Request):
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = Field(1.0, ge=0)
    top_k: int = -1
    top_p: float = Field(1.0, gt=0, le=1)


class Sample(Request):
    num_samples: int = Field(1, ge=1)
    prompt: ModelInput
    sampling_params: SamplingSettings
    base_model: str | None = Field(None, max_length=512)
    model_path: str | None = Field(None, max_length=1024)
    sampling_session_id: str | None = Field(None, max_length=160)
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None


class RetrieveFuture(Request):
    request_id: str = Field(max_length=128)
    allow_metadata_only: bool = False
