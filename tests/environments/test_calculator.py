"""The calculator environment: tool calls parsed from the assistant's text (malformed ones are
an observation, never a crash), the safe evaluator, rewards, splits and demonstrations."""

from __future__ import annotations

import pytest

from posttrain.environments import CalculatorEnv, Reset, Step, parse_tool_calls
from posttrain.environments.calculator import TOOL_NAME, evaluate_expression
from posttrain.rollouts.tool_calls import call_id


def call(expression: str, spacing: str = "") -> str:
    body = f'{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}'
    return f"<tool_call>{spacing}{body}{spacing}</tool_call>"


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def test_well_formed_calls_are_parsed_in_order_with_the_text_around_them():
    text = f"Let me compute. {call('2+3')} and {call('4*5', spacing=chr(10))}"
    content, calls = parse_tool_calls(text, first_index=3)
    assert content == "Let me compute.  and"
    assert [(c.id, c.name, dict(c.arguments), c.error) for c in calls] == [
        ("call00003", "calculator", {"expression": "2+3"}, None),
        ("call00004", "calculator", {"expression": "4*5"}, None),
    ]
    assert calls[0].as_message_entry() == {
        "id": "call00003",
        "type": "function",
        "function": {"name": "calculator", "arguments": {"expression": "2+3"}},
    }
    assert len(call_id(12345)) == 9 and call_id(7).isalnum()  # Mistral's id rule


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"', "not closed"),
        ("<tool_call>{name: calculator}</tool_call>", "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "must be a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'no "name"'),
        ('<tool_call>{"name": "calculator", "arguments": "1+1"}</tool_call>', "must be a JSON"),
    ],
)
def test_malformed_calls_carry_what_is_wrong(text, error):
    content, calls = parse_tool_calls(text)
    assert content == "" and len(calls) == 1
    assert calls[0].error is not None and error in calls[0].error
    # Kept as written, so the conversation shows what the model sent.
    assert calls[0].as_message_entry()["function"]["arguments"] == calls[0].raw  # pyright: ignore[reportIndexIssue]


def test_evaluate_expression_is_arithmetic_only():
    assert evaluate_expression("12 + 7 * 3") == 33
    assert evaluate_expression("(12 + 7) * 3") == 57
    assert evaluate_expression("-2 ** 2") == -4  # Python's precedence: -(2 ** 2)
    assert evaluate_expression("7 / 2") == 3.5
    for bad, message in [
        ("1 / 0", "division by zero"),
        ("__import__('os')", "only numbers"),
        ("x + 1", "only numbers"),
        ("2 ** 1000", "too large"),
        ("9 ** 9 ** 9", "too large"),
        ("1.5e300 ** 2", "too large"),
        ("1 +", "cannot read"),
        ("1" * 201, "longer than 200"),
    ]:
        with pytest.raises(ValueError, match=message):
            evaluate_expression(bad)


def test_reset_is_seeded_and_the_splits_are_disjoint():
    env = CalculatorEnv()
    first = env.reset(7, "train")
    assert isinstance(first, Reset)
    assert [m["role"] for m in first.messages] == ["system", "user"]
    assert first.tools is not None and first.tools[0]["function"]["name"] == TOOL_NAME  # pyright: ignore[reportIndexIssue]
    assert CalculatorEnv().reset(7, "train") == first
    train = {CalculatorEnv().reset(s, "train").messages[-1]["content"] for s in range(300)}
    held = {CalculatorEnv().reset(s, "held_out").messages[-1]["content"] for s in range(300)}
    assert len(train) > 200 and len(held) > 10  # 2 terms of 0..99 and 3 operations: many
    assert not train & held
    with pytest.raises(ValueError, match="split must be one of"):
        env.reset(0, "test")  # pyright: ignore[reportArgumentType]


def test_a_call_is_answered_by_a_tool_message_and_recorded_as_tool_calls():
    env = CalculatorEnv(system_prompt=None)
    reset = env.reset(3, "train")
    assert [m["role"] for m in reset.messages] == ["user"]
    step = env.step(assistant(f"{call(env.expression)}"))
    assert isinstance(step, Step) and not step.done and step.reward == 0.0
    value = str(int(env.answer))
    assert list(step.messages) == [
        {"role": "tool", "tool_call_id": "call00000", "name": "calculator", "content": value}
    ]
    assert step.assistant is not None and step.assistant["content"] == ""
    assert step.metrics == {"tool_calls": 1.0, "malformed_calls": 0.0, "answered": 0.0}
    # Ids go on counting over the episode.
    second = env.step(assistant(f"{call('1+1')}{call('2*2')}"))
    assert [m["tool_call_id"] for m in second.messages] == ["call00001", "call00002"]
    assert [m["content"] for m in second.messages] == ["2", "4"]
    final = env.step(assistant(f"It is {value}."))
    assert (final.done, final.reward, final.metrics["answered"]) == (True, 1.0, 1.0)


@pytest.mark.parametrize(
    ("text", "observation"),
    [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1', "not closed"),
        ("<tool_call>oops</tool_call>", "not valid JSON"),
        ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "unknown tool 'search'"),
        ('<tool_call>{"name": "calculator", "arguments": {"x": 1}}</tool_call>', "takes"),
        (call("1 / 0"), "division by zero"),
        (call("open('f')"), "only numbers"),
    ],
)
def test_a_malformed_or_failing_call_is_an_observation(text, observation):
    env = CalculatorEnv()
    env.reset(0, "train")
    step = env.step(assistant(text))
    assert not step.done and step.reward == 0.0
    (message,) = step.messages
    assert message["role"] == "tool" and message["tool_call_id"] == "call00000"
    assert str(message["content"]).startswith("error: ") and observation in message["content"]


@pytest.mark.parametrize(
    ("text", "reward"),
    [("{answer}", 1.0), (" {answer} \n", 1.0), ("The answer is {answer}.", 1.0),
     ("{wrong}", 0.0), ("{answer} and more", 0.0), ("no number", 0.0), ("", 0.0),
     ("{answer}.5", 0.0)],
)  # fmt: skip
def test_the_final_answer_is_the_number_the_message_ends_with(text, reward):
    env = CalculatorEnv()
    env.reset(11, "held_out")
    answer = str(int(env.answer))
    step = env.step(assistant(text.format(answer=answer, wrong=int(env.answer) + 1)))
    assert step.done and step.reward == reward and not step.messages


def test_step_before_reset_and_bad_options_are_errors():
    with pytest.raises(ValueError, match="before reset"):
        CalculatorEnv().step(assistant("1"))
    with pytest.raises(ValueError, match="operations"):
        CalculatorEnv(operations="+^")
    with pytest.raises(ValueError, match="no held_out question"):
        CalculatorEnv(terms=1, max_value=0).reset(0, "held_out")  # only "What is 0?"


def test_the_demonstration_solves_its_episode_when_replayed():
    env = CalculatorEnv(operations="+-*/", terms=3)
    reset = env.reset(5, "train")
    demo = list(env.demonstration())
    assert demo[: len(reset.messages)] == list(reset.messages)
    replay = CalculatorEnv(operations="+-*/", terms=3)
    replay.reset(5, "train")
    rest = demo[len(reset.messages) :]
    assert [m["role"] for m in rest] == ["assistant", "tool", "assistant"]
    step = replay.step(rest[0])
    assert list(step.messages) == [rest[1]]  # the tool answers as the demonstration says
    final = replay.step(rest[2])
    assert final.done and final.reward == 1.0
