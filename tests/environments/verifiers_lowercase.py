"""A verifiers (0.4.0) environment for the adapter's tests, self-contained: its tasks are built
in memory (no hub), its reward is shaped (the share of lowercase letters in the reply: an
untrained tiny model's replies differ in it, so a group's rewards differ and GRPO learns), and
its harness is a chat loop run in-process: verifiers lets a harness run its loop in the
evaluator as long as its model calls go through the interception endpoint it is handed, so no
sandbox and no program to install. Its taskset id is this module's name."""

from __future__ import annotations

import openai
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

WORDS = ["abc", "hello", "world", "xyz"]


def lowercase_share(text: str) -> float:
    return sum(c.islower() for c in text) / max(len(text), 1)


class LowercaseTask(vf.Task[vf.TaskData]):
    @vf.reward
    async def lowercase(self, trace: vf.Trace) -> float:
        return lowercase_share(trace.assistant_messages[-1].content or "")


class LowercaseTaskset(vf.Taskset[LowercaseTask, vf.TasksetConfig]):
    def load(self):
        for word in WORDS:
            data = vf.TaskData.model_validate({"prompt": f"say {word}"})
            yield LowercaseTask(data, self.config.task)


class ChatConfig(vf.HarnessConfig):
    edit_history: bool = False  # send earlier replies back edited, as some harnesses do


class ChatHarness(vf.Harness[ChatConfig]):
    """One chat completion per segment, streamed as verifiers' built-in chat program asks; a
    resumed segment (a user turn of a multi-turn env) sends the whole conversation."""

    EXECUTES_CODE = False
    NEEDS_CONTAINER = False
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
        system, prompt = self.resolve_prompt(data)
        messages: list = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [message_to_wire(m) for m in prompt or []]
        if self.config.edit_history:
            for message in messages:
                if message["role"] == "assistant":
                    message["content"] = f"{message['content']}!"
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            stream = await client.chat.completions.create(
                model=ctx.model, messages=messages, stream=True
            )
            async for _ in stream:
                pass
        return vf.ProgramResult(0, "", "")


async def reward_or_raise(task: vf.TaskData, trace: vf.Trace) -> float:
    """A reward to plug in by config (`taskset.task.rewards`) whose grader fails on "xyz"."""
    if "xyz" in task.prompt_text:
        raise ConnectionError("the grader is down")
    return lowercase_share(trace.assistant_messages[-1].content or "")


__all__ = ["ChatHarness", "LowercaseTaskset"]
