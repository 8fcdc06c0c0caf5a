"""An endless verifiers (0.4.0) taskset whose env plays one seat named `player`, as verifiers'
own TextArena taskset does (`TextArenaEnvConfig.player`, `INFINITE = True`), without its game
engine or downloads: the prompts are numbered moves, the reward is verifiers_lowercase's."""

from __future__ import annotations

import itertools

import verifiers.v1 as vf
from verifiers_lowercase import ChatHarness, LowercaseTask


class ArenaTaskset(vf.Taskset[LowercaseTask, vf.TasksetConfig]):
    INFINITE = True

    def load(self):
        for i in itertools.count():
            data = vf.TaskData.model_validate({"prompt": f"move {i}"})
            yield LowercaseTask(data, self.config.task)


class ArenaEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class ArenaEnv(vf.Env[ArenaEnvConfig]):
    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        async with agents.player.interaction(task) as exchange:
            await exchange.turn()


__all__ = ["ArenaEnv", "ArenaTaskset", "ChatHarness"]
