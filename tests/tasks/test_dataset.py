"""Dataset tasks: JSONL lines -> problems, the held-out split, each built-in reward and custom
ones end to end through `posttrain.evaluate`, and bad lines named by file, line and field."""

from __future__ import annotations

import json
import random
import sys

import pytest

from posttrain.models.tiny import build_tokenizer
from posttrain.rollouts.evaluation import evaluate
from posttrain.tasks import DatasetTask, Problem
from posttrain.tasks.dataset import held_out_by_hash, split_key
from posttrain.types import SampledSequence, SampleResponse


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _write(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


class Scripted:
    """Answers the i-th prompt with the i-th list of texts ("|len": cut by max_tokens), and
    records the prompts it was given, decoded."""

    policy_version: int | None = None  # no trainer behind it

    def __init__(self, tokenizer, script: list[list[str]]) -> None:
        self.tokenizer, self.script, self.prompts = tokenizer, script, []

    async def sample_many(self, prompts, num_samples, params):
        self.prompts += [self.tokenizer.decode(p) for p in prompts]
        responses = []
        for texts in self.script[: len(prompts)]:
            sequences = []
            for text in texts[:num_samples]:
                cut = text.endswith("|len")
                tokens = list(text.removesuffix("|len").encode())
                tokens += [] if cut else [self.tokenizer.eos_token_id]
                sequences.append(
                    SampledSequence("length" if cut else "stop", tokens, [0.0] * len(tokens))
                )
            responses.append(SampleResponse(sequences))
        return responses


def test_prompt_and_chat_lines_become_problems(tmp_path):
    train = _write(tmp_path / "t.jsonl", [
        {"question": "2+2", "solution": 4, "id": 1},
        "",  # blank lines are skipped, and do not shift line numbers
        {"question": "3+3", "solution": "6"},
    ])  # fmt: skip
    held = _write(tmp_path / "h.jsonl", [{"question": "5+5", "solution": "10"}])
    task = DatasetTask.from_jsonl(
        train, held, prompt_field="question", answer_field="solution", system_prompt="be brief"
    )
    first, second = task.train
    assert first.answer == "4" and first.info == {"question": "2+2", "solution": 4, "id": 1}
    assert first.source == f"{train}:1" and second.source == f"{train}:3"
    assert first.chat() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+2"},
    ]
    assert task.name == "t" and task.solution(first) == "4"
    chats = _write(tmp_path / "c.jsonl", [
        {"messages": [{"role": "user", "content": "hi"}], "answer": "hello"},
        {"messages": [{"role": "system", "content": "own"}, {"role": "user", "content": "yo"}],
         "answer": "hey"},
    ])  # fmt: skip
    held_chats = _write(tmp_path / "hc.jsonl", [
        {"messages": [{"role": "user", "content": "bye"}], "answer": "ciao"},
    ])  # fmt: skip
    task = DatasetTask.from_jsonl(
        chats, held_chats, messages_field="messages", system_prompt="default"
    )
    assert [p.chat() for p in task.train] == [
        [{"role": "system", "content": "default"}, {"role": "user", "content": "hi"}],
        [{"role": "system", "content": "own"}, {"role": "user", "content": "yo"}],  # its own wins
    ]


def test_split_of_one_file_is_disjoint_and_follows_the_documented_rule(tmp_path):
    records = [{"prompt": f"q{i}", "answer": str(i)} for i in range(2000)]
    records += records[:100]  # duplicates land on the same side as their first copy
    path = _write(tmp_path / "all.jsonl", records)
    task = DatasetTask.from_jsonl(path, held_out_fraction=0.2)
    train = {p.prompt for p in task.train}
    held = {p.prompt for p in task.held_out_problems}
    assert not train & held and train | held == {f"q{i}" for i in range(2000)}
    # The documented rule, recomputed: blake2b-64 of the prompt / 2**64 < fraction.
    import hashlib

    def rule(prompt: str) -> bool:
        digest = hashlib.blake2b(prompt.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2**64 < 0.2

    assert held == {f"q{i}" for i in range(2000) if rule(f"q{i}")}
    # 2000 x 0.2 = 400 expected, binomial std sqrt(2000 x 0.2 x 0.8) = 18: 5 std is 90.
    assert abs(len(held) - 400) < 90
    # The default fraction is 0.1, and training draws never reach a held-out prompt.
    default = DatasetTask.from_jsonl(path)
    assert {p.prompt for p in default.held_out_problems} == {
        f"q{i}" for i in range(2000) if held_out_by_hash(f"q{i}", 0.1)
    }
    drawn = {p.prompt for s in range(20) for p in default.make_prompts(random.Random(s), 500)}
    assert not drawn & {p.prompt for p in default.held_out_problems}
    # Chat prompts hash their messages as compact, key-sorted JSON.
    chat = [{"role": "user", "content": "hi"}]
    assert split_key(chat) == '[{"content":"hi","role":"user"}]'


def test_a_held_out_file_removes_its_prompts_from_training(tmp_path):
    train = _write(tmp_path / "t.jsonl", [{"prompt": p, "answer": "x"} for p in "abcd"])
    held = _write(tmp_path / "h.jsonl", [{"prompt": p, "answer": "x"} for p in "bd"])
    task = DatasetTask.from_jsonl(train, held)
    assert [p.prompt for p in task.train] == ["a", "c"] and task.dropped_from_train == 2
    assert task.held_out(0, 5) == task.held_out(0, 2)  # at most what there is
    assert task.held_out(3, 1) == task.held_out(3, 2)[:1]  # sizes nest
    # A step asking for more problems than there are gets each once per round, distinct.
    draws = task.make_prompts(random.Random(0), 5)
    assert sorted(p.prompt for p in draws[:2]) == ["a", "c"] and len(draws) == 5
    with pytest.raises(ValueError, match="give one or the other"):
        DatasetTask.from_jsonl(train, held, held_out_fraction=0.5)


@pytest.mark.parametrize(
    ("lines", "kwargs", "message"),
    [
        (['{"prompt": "a", "answer": "1"}', '{"prompt": "b"'], {}, r"t\.jsonl:2: invalid JSON: "),
        (
            ['{"prompt": "a", "answer": "1"}', "[1]"],
            {},
            r"t\.jsonl:2: each line must be a JSON object",
        ),
        (
            ['{"prompt": "a", "answer": "1"}', '{"q": "b", "answer": "2"}'],
            {},
            r"t\.jsonl:2: no field 'prompt' \(prompt_field\); the line has 'q', 'answer'",
        ),
        (
            ['{"q": "a", "answer": "1"}', '{"q": "b", "a": "2"}'],
            {"prompt_field": "q"},
            r"t\.jsonl:2: no field 'answer' \(answer_field\), which the reward compares with",
        ),
        (
            ['{"q": "a", "answer": "1"}'],
            {"messages_field": "chat"},
            r"t\.jsonl:1: no field 'chat' \(messages_field\)",
        ),
        (
            [
                '{"chat": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "answer": "1"}'
            ],
            {"messages_field": "chat"},
            r"t\.jsonl:1: field 'chat' \(messages_field\) ends with role 'assistant'",
        ),
        (
            ['{"chat": [{"role": "bot", "content": "a"}], "answer": "1"}'],
            {"messages_field": "chat"},
            r"t\.jsonl:1: field 'chat' \(messages_field\): message 0 must be",
        ),
        (
            ['{"prompt": 3, "answer": "1"}'],
            {},
            r"t\.jsonl:1: field 'prompt' \(prompt_field\) must be a string",
        ),
        (
            ['{"prompt": "a", "answer": [1]}'],
            {},
            r"t\.jsonl:1: field 'answer' \(answer_field\) must be a string or a number",
        ),
        (
            ['{"prompt": "a", "answer": "1"}', '{"prompt": "b", "answer": "two"}'],
            {"reward": "number"},
            r"t\.jsonl:2: field 'answer': answer 'two' is not a number",
        ),
        ([""], {}, r"has no lines"),
        (
            ['{"prompt": "a", "answer": "1"}'],
            {"prompt_field": "prompt", "messages_field": "chat"},
            r"prompt_field \('prompt'\) and messages_field \('chat'\) are both set",
        ),
    ],
)
def test_bad_lines_name_the_file_line_and_field(tmp_path, lines, kwargs, message):
    train = _write(tmp_path / "t.jsonl", lines)
    held = _write(
        tmp_path / "h.jsonl",
        ['{"prompt": "z", "chat": [{"role": "user", "content": "z"}], "answer": "9"}'],
    )
    with pytest.raises(ValueError, match=message):
        DatasetTask.from_jsonl(train, held, **kwargs)


def test_missing_file_and_empty_splits(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl' does not exist"):
        DatasetTask.from_jsonl(tmp_path / "nope.jsonl")
    one = _write(tmp_path / "one.jsonl", [{"prompt": "a", "answer": "1"}])
    assert not held_out_by_hash("a", 0.01)
    with pytest.raises(ValueError, match="none of its 1 lines in the held-out set"):
        DatasetTask.from_jsonl(one, held_out_fraction=0.01)
    with pytest.raises(ValueError, match=r"held_out_fraction must be in \(0, 1\)"):
        DatasetTask.from_jsonl(one, held_out_fraction=1.0)


# Each reward, with the answer, a right completion, and a wrong one.
REWARDS = [
    ("exact", {}, "42", "42", "4 2"),
    ("contains", {}, "Paris", "It is Paris.", "It is Rome."),
    ("number", {"tolerance": 0.01}, "3.14159", "about 3.14", "about 3.2"),
    ("regex", {"pattern": r"answer: (\w+)"}, "blue", "answer: blue", "answer: red"),
    ("math", {}, "\\frac{1}{2}", "$\\boxed{0.5}$", "$\\boxed{0.25}$"),
]


@pytest.mark.parametrize(
    ("reward", "options", "answer", "right", "wrong"), REWARDS, ids=[r[0] for r in REWARDS]
)
async def test_each_builtin_reward_through_evaluate(
    tokenizer, tmp_path, reward, options, answer, right, wrong
):
    train = _write(tmp_path / "t.jsonl", [{"prompt": "train me", "answer": answer}])
    held = _write(
        tmp_path / "h.jsonl",
        [{"prompt": "q1", "answer": answer}, {"prompt": "q2", "answer": answer}],
    )
    task = DatasetTask.from_jsonl(train, held, reward=reward, **options)
    problems = list(task.held_out_problems)
    # q1: right, wrong, right cut by max_tokens (0: it did not end); q2: wrong x 3.
    sampler = Scripted(tokenizer, [[right, wrong, right + "|len"], [wrong, wrong, wrong]])
    result = await evaluate(sampler, task, problems, n=3, k=2, max_tokens=32)
    assert result.rewards == [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert result.accuracy == 1 / 6
    # pass@2 of q1: 1 - C(2, 2) / C(3, 2) = 1 - 1/3 = 2/3; of q2: 0. Mean: 1/3.
    assert result.pass_at_k == pytest.approx(1 / 3, abs=1e-12)
    assert result.completions[0] == [right, wrong, right]
    assert "q1" in sampler.prompts[0] and "q2" in sampler.prompts[1]


@pytest.mark.parametrize("name", ["sync_reward", "async_reward"])
async def test_custom_reward_by_dotted_path_through_evaluate(
    tokenizer, tmp_path, monkeypatch, name
):
    (tmp_path / "graders.py").write_text(
        "def sync_reward(problem, completion, stop_reason):\n"
        "    return float(completion == problem.info['target'])\n"
        "async def async_reward(problem, completion, stop_reason):\n"
        "    return float(completion == problem.info['target'])\n"
    )
    monkeypatch.delitem(sys.modules, "graders", raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))  # `search` appends to it; restored after
    train = _write(tmp_path / "t.jsonl", [{"prompt": "a", "target": "x"}])
    held = _write(tmp_path / "h.jsonl", [{"prompt": "b", "target": "y"}])
    # Found beside the data (`search`), as the job finds a module beside its config file.
    task = DatasetTask.from_jsonl(train, held, reward=f"graders:{name}", search=tmp_path)
    result = await evaluate(Scripted(tokenizer, [["y", "x"]]), task, n=2, max_tokens=4)
    assert result.rewards == [[1.0, 0.0]] and result.problems == list(task.held_out_problems)
    assert task.reward_spec == f"graders:{name}"


async def test_evaluate_defaults_to_greedy_on_the_held_out_split(tokenizer, tmp_path):
    train = _write(tmp_path / "t.jsonl", [{"prompt": "a", "answer": "1"}])
    held = _write(tmp_path / "h.jsonl", [{"prompt": p, "answer": "1"} for p in "bcd"])
    task = DatasetTask.from_jsonl(train, held)
    calls = []

    class Recording(Scripted):
        async def sample_many(self, prompts, num_samples, params):
            calls.append((len(prompts), num_samples, params))
            return await super().sample_many(prompts, num_samples, params)

    result = await evaluate(
        Recording(tokenizer, [["1"], ["2"], ["1"]]), task, held_out=2, max_tokens=5
    )
    ((count, n, params),) = calls
    assert (count, n, params.temperature, params.max_tokens) == (2, 1, 0.0, 5)
    assert result.problems == task.held_out(0, 2) and result.k == 1
    assert result.accuracy == result.pass_at_k == 0.5
    with pytest.raises(ValueError, match="1 <= k <= n"):
        await evaluate(Recording(tokenizer, []), task, n=2, k=3)
    with pytest.raises(ValueError, match="got no problems"):
        await evaluate(Recording(tokenizer, []), task, problems=[])


def test_problem_keeps_its_old_two_field_form():
    problem = Problem("reverse abc", "cba")
    assert problem.chat() == [{"role": "user", "content": "reverse abc"}]
    assert problem.where() == "the problem 'reverse abc'"
    with pytest.raises(ValueError, match=r"the problem at f\.jsonl:3 has no answer"):
        Problem("q", source="f.jsonl:3").reference()
