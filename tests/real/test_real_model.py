"""posttrain on a real pretrained model (SmolLM2-135M-Instruct, `real_model_dir`): greedy
sampling is transformers' own `generate`, the sampler's logprobs are the trainer's, generation
ends at the chat template's end of turn, and the rewards see the answer without it.

Costs, measured on a shared 2-core machine at load average ~11 with OMP_NUM_THREADS=1 (a quiet
CI runner is faster): 98 s in all. The fp32 client loads in 2 s; greedy parity (4 chats,
`generate` one by one, the sampler as one batch, a trainer pass) 28 s; bf16 (its own LoRA
client) 51 s; the RL step's sampling and rewards 11 s; the EOS variant 3 s. On a loaded machine
use one thread: two threads' OpenMP waits made the same sampling 10x slower.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from posttrain import Datum, ModelInput, create_training_client
from posttrain.clients.local import LocalTrainingClient
from posttrain.engine.decode.sampler import Sampler
from posttrain.inference.model_sampler import ModelSampler
from posttrain.models.load import load_hf_model, load_tokenizer
from posttrain.rollouts.task_rollouts import sample_groups
from posttrain.tasks import Problem
from posttrain.tokenizer import assistant_closing, end_of_turn_id, render_chat
from posttrain.types import SampleResponse, SamplingParams, StopReason

pytestmark = pytest.mark.slow

QUESTIONS = (
    "What is 7 + 5?",
    "Name three colors.",
    "Write a haiku about the sea.",
    "What is the capital of France?",
)
# Long enough for every answer above to end by itself (the longest takes 39 tokens).
MAX_TOKENS = 48
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
# Sampler (KV cache, left-padded batch) and trainer (one unpadded pass) sum the same fp32
# products in another order. tests/engine/decode/test_sampler.py allows 1e-5 where |logits| <= 4; that
# rounding grows with the logits, here up to 44, so 1e-4, which tests/engine/test_real_sizes.py
# allows for the 0.5B architecture's fp32 passes. Measured: max 1.1e-5, mean <= 2.7e-6, on
# logprobs down to -2.7. A wrong position, mask or weight moves them by >= 1e-2.
FP32_ATOL = 1e-4


def chats(tokenizer: Any) -> list[list[int]]:
    """Each question as the model's own chat template renders it, ready for the answer."""
    return [render_chat(tokenizer, [{"role": "user", "content": q}], True) for q in QUESTIONS]


def trainer_logprobs(
    client: LocalTrainingClient, prompts: list[list[int]], responses: list[SampleResponse]
) -> list[torch.Tensor]:
    """The trainer's logprobs (a `forward` pass) of each sampled answer's tokens."""
    data = []
    for prompt, response in zip(prompts, responses, strict=True):
        ids = prompt + list(response.sequences[0].tokens)
        inputs = {"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)}
        data.append(Datum(ModelInput.from_ints(ids[:-1]), inputs))
    outputs = client.forward(data, "cross_entropy").result().loss_fn_outputs
    return [
        torch.as_tensor(out["logprobs"]).float()[len(prompt) - 1 :]
        for out, prompt in zip(outputs, prompts, strict=True)
    ]


def sampler_logprobs(responses: list[SampleResponse]) -> list[torch.Tensor]:
    return [torch.tensor(r.sequences[0].logprobs) for r in responses]


@pytest.fixture(scope="module")
def fp32(real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A float32 client of the whole model (no optimizer state before a step)."""
    client = create_training_client(
        real_model_dir, dtype="float32", storage_dir=tmp_path_factory.mktemp("fp32"), lora_rank=None
    )
    yield client
    client.close()


def test_greedy_sampling_is_generate_and_its_logprobs_are_the_trainers(fp32) -> None:
    tokenizer = fp32.get_tokenizer()
    prompts = chats(tokenizer)
    batch = [ModelInput.from_ints(p) for p in prompts]
    responses = fp32.sample_many(batch, 1, GREEDY).result()  # one left-padded batch
    model: Any = fp32.dispatch.executor.workers[0].model
    for prompt, response in zip(prompts, responses, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
            )
        assert list(response.sequences[0].tokens) == out[0, len(prompt) :].tolist()
    for got, want in zip(
        sampler_logprobs(responses), trainer_logprobs(fp32, prompts, responses), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=FP32_ATOL)


def test_bf16_sampler_and_trainer_logprobs(real_model_dir: Path, tmp_path: Path) -> None:
    """bf16 weights (LoRA, its B zero: the base model): the sampler's cached decode and the
    trainer's whole pass round differently, and both round logits up to 44 to bf16, whose
    spacing there is 0.25, so each logprob may move by up to ~0.25 in either pass. Measured on
    these chats: max 0.169, mean 0.025; bounds 0.4 and 0.05 leave room for other CPUs' bf16
    kernels. (fp32 agrees to 1.1e-5; the tiny models' bf16 gap is 1.5e-2, docs/backends.md.)"""
    client = create_training_client(
        real_model_dir, lora_rank=8, dtype="bfloat16", seed=0, storage_dir=tmp_path
    )
    prompts = chats(client.get_tokenizer())
    batch = [ModelInput.from_ints(p) for p in prompts]
    responses = client.sample_many(batch, 1, GREEDY).result()
    gaps = torch.cat(
        [
            (got - want).abs()
            for got, want in zip(
                sampler_logprobs(responses),
                trainer_logprobs(client, prompts, responses),
                strict=True,
            )
        ]
    )
    assert gaps.max() <= 0.4 and gaps.mean() <= 0.05, (gaps.max(), gaps.mean())
    client.close()


class Recorded:
    """A task that records what its reward sees."""

    name = "recorded"

    def __init__(self) -> None:
        self.seen: list[tuple[str, StopReason]] = []

    def make_prompts(self, rng: object, n: int) -> list[Problem]:
        return [Problem(q) for q in QUESTIONS[:n]]

    def held_out(self, seed: int, n: int) -> list[Problem]:
        return self.make_prompts(None, n)

    def reward(self, problem: Problem, completion: str, stop_reason: StopReason) -> float:
        self.seen.append((completion, stop_reason))
        return 0.0

    def solution(self, problem: Problem) -> str:
        return ""


async def test_answers_end_at_the_end_of_turn_and_rewards_see_them_without_it(fp32) -> None:
    """The RL step's sampling (`jobs.rollouts.sample_groups`): each answer ends with the chat
    template's `<|im_end|>`, which the trajectory keeps (it is trained: the model learns to
    stop) and the reward's text does not."""
    tokenizer = fp32.get_tokenizer()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert assistant_closing(tokenizer).through_end == (im_end,)
    task = Recorded()
    step = await sample_groups(
        ModelSampler(fp32, tokenizer), task, task.make_prompts(None, 4), 1, GREEDY
    )
    texts = [text for text, _ in task.seen]
    assert [reason for _, reason in task.seen] == ["stop"] * 4
    assert "The capital of France is Paris." in texts
    for group, text in zip(step.groups, texts, strict=True):
        (trajectory,) = group.trajectories
        answer = trajectory.segments[-1].tokens
        assert answer[-1] == im_end
        assert text == tokenizer.decode(list(answer[:-1]))
        assert "<|im_end|>" not in text


def test_a_tokenizer_whose_eos_is_not_the_end_of_turn_still_stops_there(
    real_model_dir: Path, tmp_path: Path
) -> None:
    """As Qwen2.5's base models ship: EOS `<|endoftext|>`, turns ended by `<|im_end|>`. The
    sampler wrote past the answer into invented turns until max_tokens ("Paris.<|im_end|>\\n
    <|im_end|><|im_start|>system ...", stop_reason "length"); it stops at the end of turn."""
    variant = tmp_path / "eos-endoftext"
    variant.mkdir()
    for file in real_model_dir.iterdir():
        if file.suffix == ".safetensors":
            os.symlink(file.resolve(), variant / file.name)
        elif file.is_file():
            shutil.copy(file, variant / file.name)
    tokenizer_config = json.loads((variant / "tokenizer_config.json").read_text())
    (variant / "tokenizer_config.json").write_text(
        json.dumps({**tokenizer_config, "eos_token": "<|endoftext|>"})
    )
    for name in ("config.json", "generation_config.json"):
        config = json.loads((variant / name).read_text())
        (variant / name).write_text(json.dumps({**config, "eos_token_id": 0}))
    tokenizer = load_tokenizer(variant)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == 0 and end_of_turn_id(tokenizer) == im_end
    prompt = chats(tokenizer)[3]  # the capital of France
    (response,) = Sampler(load_hf_model(variant), tokenizer).sample([prompt], 1, GREEDY)
    sequence = response.sequences[0]
    assert sequence.stop_reason == "stop"
    assert tokenizer.decode(sequence.tokens) == "The capital of France is Paris.<|im_end|>"
