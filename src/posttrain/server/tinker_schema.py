"""Request bodies of the Tinker protocol's JSON endpoints (spec section 4), as pydantic models.

Unknown fields are ignored (newer SDKs add some); a body that does not fit gets FastAPI's 422
with a JSON body naming the field.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class CreateSession(Body):
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = ""
    project_id: str | None = None


class SessionRef(Body):
    session_id: str


class LoraConfig(Body):
    rank: int = 32
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(Body):
    type: str = "adamw"


class CreateModel(Body):
    session_id: str
    model_seq_id: int
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig = Field(default_factory=OptimizerConfig)


class ModelRef(Body):
    model_id: str


class OptimStep(Body):
    model_id: str
    seq_id: int
    adam_params: dict[str, Any] | None = None
    optim_params: dict[str, Any] | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeights(Body):
    model_id: str
    seq_id: int
    path: str | None = None
    overwrite: bool = False
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None


class SaveWeightsForSampler(Body):
    model_id: str
    seq_id: int
    path: str | None = None
    sampling_session_seq_id: int | None = None
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None


class LoadWeights(Body):
    path: str
    optimizer: bool = False
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    optimizer_config: OptimizerConfig | None = None


class CreateSamplingSession(Body):
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None


class Chunk(Body):
    type: str = "encoded_text"
    tokens: list[int] | None = None


class Prompt(Body):
    chunks: list[Chunk]


class SamplingParamsBody(Body):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class Sample(Body):
    num_samples: int = 1
    prompt: Prompt
    sampling_params: SamplingParamsBody = Field(default_factory=SamplingParamsBody)
    sampling_session_id: str | None = None
    base_model: str | None = None
    model_path: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    target_prompt_logprobs: dict[str, Any] | None = None


class RetrieveFuture(Body):
    request_id: str
    allow_metadata_only: bool = False


class WeightsInfo(Body):
    tinker_path: str
