"""A multi-turn verifiers (0.4.0) environment for the adapter's tests: its `Env` answers the
agent's first reply with a user turn ("again") and takes a second reply, verifiers' own way of
scripting a conversation (`agents.agent.interaction(task)`). The prompts are letters the chat
test model (tests/chat_model.py) answers in text that re-renders to its own tokens."""

from __future__ import annotations

import verifiers.v1 as vf
from verifiers_lowercase import ChatHarness, LowercaseTask


class FollowUpTaskset(vf.Taskset[LowercaseTask, vf.TasksetConfig]):
    def load(self):
        for letters in ["dcba", "hgfe"]:
            data = vf.TaskData.model_validate({"prompt": letters})
            yield LowercaseTask(data, self.config.task)


class FollowUpEnv(vf.Env[vf.SingleAgentEnvConfig]):
    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        async with agents.agent.interaction(task) as exchange:
            await exchange.turn()
            await exchange.turn("again")


__all__ = ["ChatHarness", "FollowUpEnv", "FollowUpTaskset"]
