"""Request bodies of the Tinker protocol's JSON endpoints (spec section 4), as pydantic models.

Unknown fields are ignored (newer SDKs add some); a body that does not fit gets a 422 naming the
field (see `app.invalid_request`). Every integer is bounded here, so no value reaches SQLite
(64-bit integers) or torch (token ids) that they cannot hold, and no float may be NaN or
infinite. Ranges that `posttrain.types` already checks (Adam and sampling settings) are checked
there, once, when the handler builds them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from posttrain.inference.engines import DISTRIBUTION_FIELDS
from posttrain.types import SamplingParams

INT64_MAX = 2**63 - 1
# Token ids as the protobuf carries them (int32); every vocabulary is far smaller.
TOKEN_ID_LIMIT = 2**31
MAX_NUM_SAMPLES = 1024
MAX_SAMPLE_TOKENS = 1 << 24  # beyond any model's context

SeqId = Annotated[int, Field(ge=0, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, lt=TOKEN_ID_LIMIT)]
Seed = Annotated[int, Field(ge=-(2**63), le=INT64_MAX)]
Ttl = Annotated[int, Field(ge=0, le=INT64_MAX)]


def unencodable_text(value: object) -> str | None:
    """Where in `value` the first string is that UTF-8 cannot encode (`tags[0]`, `a key of
    user_metadata`, `the body`), or None.

    JSON escapes can spell a lone surrogate ("\\ud800"), which `json.loads` accepts but neither
    SQLite nor a JSON response can encode. Walked with a stack: bodies may nest deeply.
    """
    stack: list[tuple[str, object]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return path or "the body"
        elif isinstance(item, dict):
            for key, child in item.items():
                # The key is looked at before its value, whose path spells the key.
                stack.append((f"{path}.{key}" if path else str(key), child))
                stack.append((f"a key of {path or 'the body'}", key))
        elif isinstance(item, list | tuple):
            stack.extend((f"{path}[{i}]", child) for i, child in enumerate(item))
    return None


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _encodable(cls, data: object) -> object:
        where = unencodable_text(data)
        if where is not None:
            raise ValueError(
                f"{where} holds a lone UTF-16 surrogate (such as \\ud800), which is not text; "
                "send valid Unicode"
            )
        return data


class CreateSession(Body):
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = ""
    project_id: str | None = None


class SessionRef(Body):
    session_id: str


class LoraConfig(Body):
    # DEFAULT_LORA_RANK (models.load), written out so the schema imports no torch; a test pins it.
    rank: int = Field(default=32, ge=1, le=65536)  # the server's --lora-rank-max applies too
    seed: int | None = Field(default=None, ge=0, le=INT64_MAX)
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(Body):
    type: str = "adamw"


class CreateModel(Body):
    session_id: str
    model_seq_id: SeqId
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig = Field(default_factory=OptimizerConfig)


class ModelRef(Body):
    model_id: str


class OptimParams(Body):
    """`adam_params` as the SDK sends it (its `AdamParams`), or `optimizer_params` with a `type`.

    Types only: the ranges are `posttrain.types.AdamParams`'s. Other keys are kept so that the
    handler can refuse them by name rather than ignore them.
    """

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    type: str = "adamw"
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStep(Body):
    model_id: str
    seq_id: SeqId
    adam_params: OptimParams | None = None
    optim_params: OptimParams | None = None
    optimizer_params: OptimParams | None = None


class SaveWeights(Body):
    model_id: str
    seq_id: SeqId
    path: str | None = None
    overwrite: bool = False
    ttl_seconds: Ttl | None = None
    user_metadata: dict[str, str] | None = None


class SaveWeightsForSampler(Body):
    model_id: str
    seq_id: SeqId
    path: str | None = None
    sampling_session_seq_id: SeqId | None = None
    ttl_seconds: Ttl | None = None
    user_metadata: dict[str, str] | None = None


class SaveWeightsExternal(Body):
    model_id: str
    seq_id: SeqId
    # A file name under the model's storage: letters, digits, '.', '_' and '-'.
    path: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")]
    ttl_seconds: Ttl | None = None


class LoadWeights(Body):
    path: str
    optimizer: bool = False
    model_id: str | None = None
    seq_id: SeqId | None = None
    session_id: str | None = None
    model_seq_id: SeqId | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    optimizer_config: OptimizerConfig | None = None


class CreateSamplingSession(Body):
    session_id: str
    sampling_session_seq_id: SeqId
    base_model: str | None = None
    model_path: str | None = None


class Chunk(Body):
    type: Literal["encoded_text"] = "encoded_text"  # image chunks: text models only
    tokens: list[TokenId]


class Prompt(Body):
    chunks: list[Chunk]


class SamplingParamsBody(Body):
    """Types and integer bounds; the ranges are `posttrain.types.SamplingParams`'s.

    Beyond the SDK's fields, those of SamplingParams that shape the distribution (min_p,
    repetition_penalty, presence_penalty, frequency_penalty, and any added later) are taken
    from extra keys, posttrain serve's extension for clients that send them (the tinker SDK
    0.38 has no such fields); other extra keys are ignored, as before."""

    model_config = ConfigDict(extra="allow", protected_namespaces=(), allow_inf_nan=False)

    max_tokens: int | None = Field(default=None, ge=1, le=MAX_SAMPLE_TOKENS)
    seed: Seed | None = None
    stop: str | list[str] | list[TokenId] | None = None
    temperature: float = 1.0
    top_k: int = Field(default=-1, ge=-1, lt=TOKEN_ID_LIMIT)
    top_p: float = 1.0

    def params(self) -> SamplingParams:
        """posttrain's SamplingParams (ValueError naming a field out of its range)."""
        extra = self.model_extra or {}
        shaping = {k: extra[k] for k in DISTRIBUTION_FIELDS if extra.get(k) is not None}
        declared = {name: getattr(self, name) for name in type(self).model_fields}
        return SamplingParams(**declared, **shaping)


class Sample(Body):
    num_samples: int = Field(default=1, ge=1, le=MAX_NUM_SAMPLES)
    prompt: Prompt
    sampling_params: SamplingParamsBody = Field(default_factory=SamplingParamsBody)
    sampling_session_id: str | None = None
    base_model: str | None = None
    model_path: str | None = None
    seq_id: SeqId | None = None
    prompt_logprobs: bool = False
    # Not supported (refused when asked for), bounded all the same.
    topk_prompt_logprobs: int = Field(default=0, ge=0, lt=TOKEN_ID_LIMIT)
    topk_sample_logprobs: int = Field(default=0, ge=0, lt=TOKEN_ID_LIMIT)
    prompt_alt_tokens_k: int = Field(default=0, ge=0, lt=TOKEN_ID_LIMIT)
    prompt_logprobs_last_n: int | None = Field(default=None, ge=0, le=INT64_MAX)
    target_prompt_logprobs: dict[str, Any] | None = None


class RetrieveFuture(Body):
    request_id: str
    allow_metadata_only: bool = False


class WeightsInfo(Body):
    tinker_path: str


class FinishReason(Body):
    type: str = "finished"


class FinishSession(Body):
    reason: FinishReason | None = None
