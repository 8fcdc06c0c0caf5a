"""backend.train(..., teacher=...): on-policy distillation through the shared trainer.

The teacher's scores equal a naive forward pass of the teacher model on the exact tokens; a
teacher with another vocabulary is refused before any step, naming both models; a short
distillation lowers the reverse KL; wrong combinations name the option and the fix; every
backend reports `teacher_kl` and the same loss (Tinker against a real `posttrain serve`, the
teacher there too through the tinker SDK).

Tolerances: teacher logprobs against a naive forward 1e-5 absolute (the same fp32 weights, the
sampler's chunked logprob kernel against a plain log_softmax). Backends against LocalBackend as
in test_dpo.py: 1e-5 relative on losses.
"""

from __future__ import annotations

import asyncio
import warnings
from pathlib import Path

import pytest
import torch
from backend_kinds import MakeBackend, tiny

from local_groups import synthetic_groups
from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.backends.options import LocalRLOptions
from posttrain.backends.plugins.schema import option_schema
from posttrain.backends.preflight import PreflightError
from posttrain.backends.tinker import TinkerRLConfig, TinkerRLOptions
from posttrain.clients.create import create_training_client
from posttrain.clients.local_sampling import LocalSamplingClient
from posttrain.clients.teacher import Teacher
from posttrain.data.trajectories import TokenSegment, Trajectory, TrajectoryGroup
from posttrain.models.load import load_hf_model
from posttrain.models.tiny import build_tokenizer, make_tiny_model
from posttrain.trainer.config import RLConfig
from posttrain.trainer.distill import score_groups
from posttrain.types import SampledSequence, SamplingParams

PROMPT = (256, 104, 105)  # <|bos|> "hi"
# The teacher is the tiny model with its unembedding scaled by 40: the same ranking of tokens
# as the student's, far sharper (reverse KL about 12 nats), so distillation has a clear target.
SHARPEN = 40.0


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_model(tmp_path_factory.mktemp("sharp-teacher"), seed=0)
    model = load_hf_model(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(SHARPEN)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def teacher_client(teacher_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    training = create_training_client(
        teacher_dir, storage_dir=tmp_path_factory.mktemp("t"), lora_rank=None
    )
    sampler = training.save_weights_and_get_sampling_client().result()
    yield sampler
    sampler.close()
    training.close()


def sharp(client: LocalSamplingClient) -> Teacher:
    return Teacher(client, name="sharp-teacher")


async def test_teacher_scores_equal_a_naive_forward_on_the_exact_tokens(
    teacher_dir, teacher_client
):
    groups = synthetic_groups(0, groups=2, size=3)
    scored = await score_groups(sharp(teacher_client), groups)
    model = load_hf_model(teacher_dir)
    for group, row in zip(groups, scored, strict=True):
        for trajectory, teacher_T in zip(group.trajectories, row, strict=True):
            tokens = [t for s in trajectory.segments for t in s.tokens]
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([tokens])).logits[0]
            logp = torch.log_softmax(logits.double(), dim=-1)
            naive = [float(logp[p - 1, tokens[p]]) for p in range(1, len(tokens))]
            assert teacher_T.tolist() == pytest.approx(naive, abs=1e-5)


class OtherVocabulary:
    """A teacher client whose tokenizer has one extra token (a different vocabulary)."""

    async def compute_logprobs(self, prompt: object) -> list[float | None]:
        raise AssertionError("a refused teacher is never called")

    def get_tokenizer(self) -> object:
        tokenizer = build_tokenizer()
        tokenizer.add_tokens(["<|tool|>"])
        return tokenizer


async def test_a_teacher_with_another_vocabulary_is_refused_before_any_step(
    tiny_model_dir, tmp_path
):
    backend = LocalBackend(tmp_path)
    model = tiny("student", tiny_model_dir)
    await model.register(backend)
    teacher = Teacher(OtherVocabulary(), name="qwen-teacher")
    with pytest.raises(PreflightError) as caught:
        await backend.train(model, synthetic_groups(0), teacher=teacher)
    message = str(caught.value)
    assert "teacher: teacher 'qwen-teacher' and student 'student'" in message
    assert str(tiny_model_dir) in message  # the student's base model
    assert "the teacher's vocabulary has 261 tokens, the student's 260" in message
    assert "same tokenizer" in message
    assert model.step == 0
    await backend.close()


def _logprobs(sequence: SampledSequence) -> tuple[float, ...]:
    assert sequence.logprobs is not None
    return tuple(sequence.logprobs)


async def sampled_groups(backend: LocalBackend, model: TrainableModel) -> list[TrajectoryGroup]:
    sampler = backend.sampling_client(model)
    params = SamplingParams(max_tokens=8, temperature=1.0)
    responses = await sampler.sample_many([list(PROMPT)] * 8, 8, params)
    return [
        TrajectoryGroup(
            tuple(
                Trajectory(
                    (TokenSegment(PROMPT), TokenSegment(tuple(s.tokens), True, _logprobs(s))),
                    reward=0.0,
                )
                for s in response.sequences
            )
        )
        for response in responses
    ]


async def test_a_short_distillation_lowers_the_reverse_kl(tiny_model_dir, tmp_path, teacher_client):
    # Measured: teacher_kl 11.6 -> 6.0 over 15 steps (exact KL on fixed text 12.1 -> 8.0);
    # every group has reward 0, so only the teacher's advantages train.
    backend = LocalBackend(tmp_path)
    model = TrainableModel(name="s", project="p", base_model=str(tiny_model_dir), lora_rank=None)
    await model.register(backend)
    teacher = sharp(teacher_client)
    kl = []
    for _ in range(12):
        groups = await sampled_groups(backend, model)
        result = await backend.train(
            model, groups, teacher=teacher, learning_rate=1e-2, save_checkpoint=False
        )
        assert result.metrics["num_dropped_groups"] == 0  # equal rewards: kept all the same
        kl.append(result.metrics["teacher_kl"])
    await backend.close()
    first, last = sum(kl[:3]) / 3, sum(kl[-3:]) / 3
    assert first > 8.0
    assert last < 0.85 * first, kl


@pytest.mark.parametrize(
    ("options", "option", "fix"),
    [
        ({"distill_reward_coef": 0.5}, "distill_reward_coef", "pass teacher=Teacher"),
        ({"token_transform": "gtpo"}, "token_transform", "drop it, or drop teacher"),
        ({"algorithm_mode": "reinforce_pp_none"}, "advantage_estimator", "drop it, or drop"),
        ({"advantage_estimator": "gae"}, "advantage_estimator", "drop it, or drop"),
        (
            {"allow_training_without_logprobs": True},
            "allow_training_without_logprobs",
            "sample with logprobs",
        ),
    ],
)
async def test_wrong_combinations_name_the_option_and_the_fix(
    tmp_path, teacher_client, options, option, fix
):
    # Preflight runs before the model is looked at: it is never registered.
    backend = LocalBackend(tmp_path)
    model = TrainableModel(
        name="m", project="p", base_model=str(tmp_path / "never-loaded"), lora_rank=8
    )
    if option != "distill_reward_coef":
        options = {**options, "teacher": sharp(teacher_client)}
    with pytest.raises(PreflightError) as caught:
        await backend.train(model, synthetic_groups(0), **options)
    message = str(caught.value)
    assert f"  - {option}: " in message and fix in message


def test_the_option_schemas_list_the_teacher_and_its_coefficient():
    for options_type, config in ((LocalRLOptions, RLConfig), (TinkerRLOptions, TinkerRLConfig)):
        rows = {o.name: o for o in option_schema(options_type, config)}
        assert rows["teacher"].type == "Teacher | null" and rows["teacher"].default is None
        assert "teacher - student logprob" in rows["teacher"].description
        assert rows["distill_reward_coef"].default == 0.0


def fixed_groups() -> list[TrajectoryGroup]:
    """Sampler logprobs near the tiny model's (about -5.56 on its 260 tokens)."""
    return synthetic_groups(3, groups=2, size=4)


async def test_every_backend_distills_with_the_same_loss(
    kind: str, make_backend: MakeBackend, tiny_model_dir, tmp_path, teacher_client
):
    teacher = sharp(teacher_client)
    results = {}
    for name, make in (("local", lambda p: LocalBackend(p)), (kind, make_backend)):
        backend = make(tmp_path / name)
        model = tiny(f"student-{name}", tiny_model_dir, seed=1)
        await model.register(backend)
        results[name] = await backend.train(
            model, fixed_groups(), teacher=teacher, learning_rate=1e-3, save_checkpoint=False
        )
        await backend.close()
    local, other = results["local"].metrics, results[kind].metrics
    assert other["teacher_kl"] == local["teacher_kl"]  # the same teacher on the same tokens
    assert other["loss"] == pytest.approx(local["loss"], rel=1e-5)


@pytest.mark.slow
async def test_a_teacher_behind_posttrain_serve(tiny_model_dir, server, teacher_client):
    """The tinker SDK's SamplingClient on `posttrain serve` as the teacher: its scores equal
    the same model's scores in this process."""
    tinker = pytest.importorskip("tinker")
    from serve_helpers import KEY  # pyright: ignore[reportMissingImports]

    service = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    # The docs' form: create_sampling_client's future, not the client it resolves to.
    remote = service.create_sampling_client(base_model=str(tiny_model_dir))
    tokenizer = build_tokenizer()
    teacher = Teacher.from_tinker(remote, tokenizer=tokenizer, name="served")
    training = create_training_client(tiny_model_dir, lora_rank=None)
    local = Teacher(training.save_weights_and_get_sampling_client().result(), name="local")
    groups = fixed_groups()
    with warnings.catch_warnings():
        # The SDK warns on each call through the future ("Using the future as the
        # SamplingClient is deprecated"): the teacher resolves it instead.
        warnings.simplefilter("error", FutureWarning)
        got, want = await asyncio.gather(score_groups(teacher, groups), score_groups(local, groups))
    for got_row, want_row in zip(got, want, strict=True):
        for g, w in zip(got_row, want_row, strict=True):
            assert g.tolist() == pytest.approx(w.tolist(), abs=1e-5)
    training.close()
