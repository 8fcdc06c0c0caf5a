"""Job rollouts with a scripted sampler: one batched call per step, rewards on exact tokens."""

from __future__ import annotations

import pytest

from chat_templates import template as chat_template
from posttrain.models.tiny import build_tokenizer
from posttrain.rollouts.evaluation import evaluate
from posttrain.rollouts.task_rollouts import completion_text, derive_seed, sample_groups
from posttrain.tasks import Problem, ReverseTask
from posttrain.tokenizer import assistant_closing
from posttrain.types import SampledSequence, SampleResponse, SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


class ScriptedSampler:
    """Answers each prompt with the given completions (texts; "|len" marks a cut one)."""

    policy_version: int | None = None  # no trainer behind it

    def __init__(self, tokenizer, script: list[list[str]]) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.calls: list[tuple[int, int, SamplingParams]] = []

    def _sequence(self, text: str) -> SampledSequence:
        cut = text.endswith("|len")
        tokens = list(text.removesuffix("|len").encode())
        if not cut:
            tokens.append(self.tokenizer.eos_token_id)
        return SampledSequence("length" if cut else "stop", tokens, [-0.5] * len(tokens))

    async def sample_many(self, prompts, num_samples, params):
        self.calls.append((len(prompts), num_samples, params))
        return [
            SampleResponse([self._sequence(t) for t in texts[:num_samples]])
            for texts in self.script
        ]


def test_completion_text_drops_only_the_end_of_turn(tokenizer):
    eos = tokenizer.eos_token_id
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    closing = assistant_closing(tokenizer)
    assert completion_text(tokenizer, SampledSequence("stop", [*b"cba", eos]), closing) == "cba"
    assert completion_text(tokenizer, SampledSequence("length", [*b"cba"]), closing) == "cba"
    # Another special token stays visible, so such a completion can never equal an answer.
    with_special = SampledSequence("stop", [*b"cba", im_start, eos])
    assert completion_text(tokenizer, with_special, closing) == "cba<|im_start|>"
    # Llama 2's template ends a turn with " " EOS, which a model trained on it samples: the
    # answer is "cba" with or without the space; a completion cut by max_tokens keeps it.
    llama2 = chat_template("llama2").tokenizer
    closing = assistant_closing(llama2)
    for tokens in ([*b"cba ", eos], [*b"cba", eos]):
        assert completion_text(llama2, SampledSequence("stop", tokens), closing) == "cba"
    assert completion_text(llama2, SampledSequence("length", [*b"cba "]), closing) == "cba "


def test_completion_text_with_stop_strings_is_the_text_before_the_first(tokenizer):
    closing = assistant_closing(tokenizer)
    # " 12\n" stopped on the stop string "\n": the answer is " 12", whatever token held it.
    stopped = SampledSequence("stop", [*b" 12\n"])
    assert completion_text(tokenizer, stopped, closing, ("\n",)) == " 12"
    assert (
        completion_text(tokenizer, SampledSequence("stop", [*b"7.\n"]), closing, ("\n", ".")) == "7"
    )
    # Cut by max_tokens, nothing is dropped.
    assert completion_text(tokenizer, SampledSequence("length", [*b" 1"]), closing, ("\n",)) == " 1"


def test_derive_seed_is_stable_and_63_bit():
    # Pinned: seeds must not change between processes or Python versions (resume relies on it).
    assert derive_seed(0, "rl", 5) == derive_seed(0, "rl", 5)
    assert derive_seed(0, "rl", 5) != derive_seed(0, "rl", 6)
    assert 0 <= derive_seed(1, "x") < 2**63
    assert derive_seed(0, "sft") == 8073433320436520856  # blake2b-64("0:sft") >> 1


async def test_sample_groups_rewards_each_completion(tokenizer):
    problems = [Problem("reverse abc", "cba"), Problem("reverse xyz", "zyx")]
    sampler = ScriptedSampler(tokenizer, [["cba", "abc", "cba|len"], ["zyx", "zyx", "zy"]])
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=1)
    step = await sample_groups(sampler, ReverseTask(), problems, 3, params)
    groups = step.groups
    assert (step.bad_rollouts, step.rollouts) == (0, 6)
    assert len(sampler.calls) == 1 and sampler.calls[0] == (2, 3, params)  # one batched call
    assert [g.rewards for g in groups] == [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    first = groups[0].trajectories[0]
    assert first.metrics == {"accuracy": 1.0, "completion_tokens": 4.0}  # c, b, a, EOS
    assert first.metadata == {"prompt": "reverse abc", "answer": "cba", "completion": "cba"}
    prompt, completion = first.segments
    assert not prompt.trainable and completion.trainable
    assert completion.tokens == (*b"cba", tokenizer.eos_token_id)
    assert completion.logprobs == (-0.5,) * 4


async def test_evaluate_is_greedy_accuracy(tokenizer):
    problems = [Problem("reverse abc", "cba"), Problem("reverse xyz", "zyx")]
    sampler = ScriptedSampler(tokenizer, [["cba"], ["zy"]])
    result = await evaluate(sampler, ReverseTask(), problems, max_tokens=8)
    assert result.accuracy == 0.5 and result.completions == [["cba"], ["zy"]]
    ((_, num_samples, params),) = sampler.calls
    assert num_samples == 1 and params.temperature == 0.0 and params.max_tokens == 8
