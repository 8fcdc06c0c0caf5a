"""A tiny reward model built here (LlamaForSequenceClassification, random weights): its scores are
those of a direct transformers forward of each input alone, mapped by the documented rule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from posttrain.models.tiny import build_tokenizer
from posttrain.tasks import DatasetTask, Problem, RewardModel
from posttrain.tasks.rewards import score_group

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
# Different lengths, so a batch pads: each score must still be its input's alone.
COMPLETIONS = ["5", "It is five.", "", "55555 55555 55555"]


def save_reward_model(path: Path, num_labels: int, *, chat_template: bool = True) -> None:
    torch.manual_seed(num_labels)
    tokenizer = build_tokenizer()
    if not chat_template:
        tokenizer.chat_template = None
    pad = tokenizer.pad_token_id
    assert isinstance(pad, int)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=pad,
    )
    config.num_labels = num_labels  # a PretrainedConfig keyword that LlamaConfig's stub omits
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def direct_logits(path: Path, text: str, special: bool) -> torch.Tensor:
    """The head's logits of one unpadded input, by hand."""
    tokenizer = build_tokenizer()
    model = LlamaForSequenceClassification.from_pretrained(path).eval()
    ids = tokenizer(text, add_special_tokens=special, return_tensors="pt")
    with torch.no_grad():
        return model(**ids).logits[0]


@pytest.mark.parametrize("num_labels, transform", [(1, "sigmoid"), (1, "raw"), (2, "sigmoid")])
async def test_scores_are_a_direct_forward_mapped_by_the_rule(tmp_path, num_labels, transform):
    save_reward_model(tmp_path, num_labels)
    model = RewardModel(tmp_path, transform=transform, batch_size=3, device="cpu")
    scores = await model.score_group(CHAT, COMPLETIONS)  # batches of 3 and 1
    tokenizer = build_tokenizer()
    want = []
    for completion in COMPLETIONS:
        turns = [*CHAT, {"role": "assistant", "content": completion}]
        text = tokenizer.apply_chat_template(turns, tokenize=False)
        logits = direct_logits(tmp_path, str(text), special=False)
        if num_labels == 2:
            want.append(torch.softmax(logits, -1)[1].item())  # label 1's probability
        elif transform == "sigmoid":
            want.append(torch.sigmoid(logits[0]).item())
        else:
            want.append(logits[0].item())
    # fp32, the same kernels; padding only adds masked positions: ~1e-6 relative.
    assert scores == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert len(set(scores)) == len(scores)  # the completions are told apart


async def test_without_a_chat_template_the_text_is_joined_by_newlines(tmp_path):
    save_reward_model(tmp_path, 1, chat_template=False)
    model = RewardModel(tmp_path, device="cpu")
    score = await model.score(CHAT, "5")
    logit = direct_logits(tmp_path, "Be brief.\n2+3?\n5", special=True)[0]
    assert score == pytest.approx(torch.sigmoid(logit).item(), rel=1e-5)


async def test_a_dataset_task_scores_each_group_in_one_call(tmp_path):
    save_reward_model(tmp_path / "rm", 1)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(f'{{"prompt": "p{i}"}}\n' for i in range(10)))
    model = RewardModel(tmp_path / "rm", device="cpu")
    task = DatasetTask.from_jsonl(data, held_out_fraction=0.5, reward=model)
    assert task.reward_spec == f"model:{tmp_path / 'rm'}" and task.group_reward is not None
    problem = task.train[0]
    got = await score_group(task, problem, ["a", "b"], ["stop", "length"])
    assert got == await model.score_group(problem.chat(), ["a", "b"])


def test_bad_reward_models_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        RewardModel(tmp_path)
    save_reward_model(tmp_path, 3)
    with pytest.raises(ValueError, match="has 3 labels"):
        RewardModel(tmp_path, device="cpu").score_texts_sync([], ["x"])
    with pytest.raises(ValueError, match="transform"):
        RewardModel(tmp_path, transform="tanh")
    assert Problem("p").chat() == [{"role": "user", "content": "p"}]
