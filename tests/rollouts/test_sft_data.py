"""`load_sft_dataset`: chat JSONL -> trajectories with exactly the assistant turns trainable."""

from __future__ import annotations

import json

import pytest

from chat_templates import TEMPLATES
from chat_templates import template as chat_template
from posttrain.models.tiny import build_tokenizer
from posttrain.rollouts.sft_data import conversation_to_trajectory, load_sft_dataset


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_single_turn(tokenizer, tmp_path):
    messages = [{"role": "user", "content": "reverse abc"}, {"role": "assistant", "content": "cba"}]
    (trajectory,) = load_sft_dataset(
        _write(tmp_path / "d.jsonl", [{"messages": messages}]), tokenizer
    )
    full = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert trajectory.tokens == list(full)  # exactly the template's rendering
    context, answer = trajectory.segments
    assert not context.trainable and answer.trainable
    # The byte tokenizer: one token per character, then EOS (what the sampler stops on).
    assert list(answer.tokens) == [*b"cba", tokenizer.eos_token_id]
    prompt = tokenizer.apply_chat_template(
        messages[:1], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert list(context.tokens) == list(prompt)
    assert trajectory.messages == tuple(messages)


def test_multi_turn_marks_every_assistant_turn(tokenizer):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": "4"},
    ]
    trajectory = conversation_to_trajectory(messages, tokenizer)
    assert [s.trainable for s in trajectory.segments] == [False, True, False, True]
    eos = tokenizer.eos_token_id
    assert [list(s.tokens) for s in trajectory.segments if s.trainable] == [
        [ord("2"), eos],
        [ord("4"), eos],
    ]
    full = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert trajectory.tokens == list(full)
    assert trajectory.num_trainable_tokens == 4


def test_trailing_user_turn_is_not_kept(tokenizer):
    # Nothing after the last assistant turn can be trained on; it is left out.
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    trajectory = conversation_to_trajectory(messages, tokenizer)
    assert trajectory.segments[-1].trainable


def test_blank_lines_are_skipped(tokenizer, tmp_path):
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"messages": messages}) + "\n\n" + json.dumps({"messages": messages}) + "\n"
    )
    assert len(load_sft_dataset(path, tokenizer)) == 2


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"d\.jsonl:2: invalid JSON: "),
        ("[1, 2]", r"d\.jsonl:2: each line must be a JSON object, got list"),
        (
            json.dumps({"msgs": []}),
            r"d\.jsonl:2: no field 'messages' \(a chat\), nor both 'prompt' and 'answer' "
            r"\(a prompt and its answer\); the line has 'msgs'",
        ),
        (
            json.dumps({"prompt": "x", "answer": ["y"]}),
            r"d\.jsonl:2: field 'answer' must be a string, got \['y'\]",
        ),
        (
            json.dumps({"messages": []}),
            r"d\.jsonl:2: field 'messages': messages must be a non-empty list",
        ),
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}]}),
            r"d\.jsonl:2: field 'messages': messages has no assistant turn",
        ),
        (
            json.dumps({"messages": [{"role": "user", "text": "x"}]}),
            r"d\.jsonl:2: field 'messages': messages\[0\] must be",
        ),
        (
            json.dumps({"messages": [{"role": "bot", "content": "x"}]}),
            r"d\.jsonl:2: field 'messages': messages\[0\] needs a role in",
        ),
    ],
)
def test_bad_lines_name_the_file_and_line(tokenizer, tmp_path, line, message):
    good = json.dumps(
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}
    )
    path = tmp_path / "d.jsonl"
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message):
        load_sft_dataset(path, tokenizer)


def test_missing_or_empty_file(tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_sft_dataset(tmp_path / "nope.jsonl", tokenizer)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="has no conversations"):
        load_sft_dataset(tmp_path / "empty.jsonl", tokenizer)


def test_path_only_gives_the_checked_conversations(tokenizer, tmp_path):
    first = [{"role": "user", "content": "reverse abc"}, {"role": "assistant", "content": "cba"}]
    second = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},
    ]
    path = _write(tmp_path / "d.jsonl", [{"messages": first}, {"messages": second}])
    assert load_sft_dataset(path) == [first, second]
    # With a tokenizer: the same conversations, as trajectories for backend.train_sft.
    trajectories = load_sft_dataset(path, tokenizer)
    assert [t.messages for t in trajectories] == [tuple(first), tuple(second)]
    assert trajectories == [conversation_to_trajectory(m, tokenizer) for m in (first, second)]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: field 'messages': messages\[0\] must be"):
        load_sft_dataset(tmp_path / "bad.jsonl")  # checked without a tokenizer too


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_each_turn_trains_through_its_end_of_turn_token(name):
    """What a sampler produces is trained, up to the EOS it stops on: Llama 2's space before
    the EOS with the EOS (so the model learns to stop), never Qwen's newline after it."""
    template = chat_template(name)
    tokenizer, before, after = template.tokenizer, template.before_end, template.after_end
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    trajectory = conversation_to_trajectory(messages, tokenizer)
    eos = tokenizer.eos_token_id
    assert [list(s.tokens) for s in trajectory.segments if s.trainable] == [
        [ord("b"), *before, eos],
        [ord("d"), *before, eos],
    ]
    assert [s.trainable for s in trajectory.segments] == [False, True, False, True]
    assert trajectory.segments[2].tokens[: len(after)] == after  # the first turn's rest: context
    full = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert trajectory.tokens == list(full)[: len(full) - len(after)]  # all but the last rest


def test_a_dataset_finds_the_closing_once(tmp_path, monkeypatch):
    """Two renderings per assistant turn, plus two for the template's closing per dataset."""
    tokenizer = build_tokenizer()
    renders = []
    render = tokenizer.apply_chat_template
    monkeypatch.setattr(
        tokenizer, "apply_chat_template", lambda *a, **k: renders.append(1) or render(*a, **k)
    )
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    load_sft_dataset(_write(tmp_path / "d.jsonl", [{"messages": messages}] * 3), tokenizer)
    assert len(renders) == 2 + 3 * 2


def test_exported_at_top_level():
    import posttrain

    assert posttrain.load_sft_dataset is load_sft_dataset


def test_prompt_answer_pairs_train_only_the_answer(tokenizer, tmp_path):
    """A prompt/answer line is a user turn and the assistant's answer (a number answer as its
    decimal), with the system prompt before it; only the answer's tokens are trainable."""
    from posttrain.rollouts.sft_data import SFTFields

    path = _write(
        tmp_path / "d.jsonl",
        [{"q": "2+2=", "a": 4}, {"messages": [{"role": "user", "content": "x"},
                                               {"role": "assistant", "content": "y"}]}],
    )  # fmt: skip
    fields = SFTFields(prompt="q", answer="a", system_prompt="be brief")
    assert load_sft_dataset(path, fields=fields) == [
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "2+2="},
            {"role": "assistant", "content": "4"},
        ],
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "y"},
        ],
    ]
    first, _ = load_sft_dataset(path, tokenizer, fields=fields)
    assert [list(s.tokens) for s in first.segments if s.trainable] == [
        [ord("4"), tokenizer.eos_token_id]
    ]
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2="}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert list(first.segments[0].tokens) == list(prompt) and not first.segments[0].trainable
