"""posttrain: post-train language models with RL and SFT on one training core, many backends."""

from posttrain.types import (
    AdamParams,
    Datum,
    EncodedTextChunk,
    ModelInput,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    TokenSegment,
    TrainResult,
    Trajectory,
    TrajectoryGroup,
)

__version__ = "0.1.0"

__all__ = [
    "AdamParams",
    "Datum",
    "EncodedTextChunk",
    "ModelInput",
    "SampleResponse",
    "SampledSequence",
    "SamplingParams",
    "TokenSegment",
    "TrainResult",
    "Trajectory",
    "TrajectoryGroup",
    "__version__",
]
