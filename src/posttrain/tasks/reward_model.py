"""Reward models: a local `AutoModelForSequenceClassification` directory scores completions, as a
dataset task's reward (`[data] reward = "model:PATH"`, options in `[reward_model]`) or from
Python (`await RewardModel(path).score(prompt, completion)`).

What the model reads: when its tokenizer has a chat template, the problem's chat followed by
the completion as an assistant turn, rendered by the template (no generation prompt) and
tokenized without adding special tokens (the template writes its own); without one, the
contents of the chat's messages and the completion joined by newlines, tokenized with the
tokenizer's special tokens. Inputs longer than `max_length` keep their first tokens.

The score, from the logits of the model's head:
- one label: `sigmoid(logit)` (`transform = "sigmoid"`, in (0, 1)) or the logit itself
  (`transform = "raw"`);
- two labels: the softmax probability of label 1;
- any other number of labels is an error when the model loads.

The model loads once, at the first score, on `device` (None: CUDA when available, else CPU) in
eval mode; each problem's completions are scored in batches of `batch_size`, right-padded with
the tokenizer's pad token (its EOS when it has none), one batch at a time.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from posttrain.algo.config_fields import AT_LEAST_ONE, option
from posttrain.algo.config_fields import from_options as build_options
from posttrain.tasks.judge_prompts import Prompt, chat_of
from posttrain.tasks.protocol import Problem
from posttrain.tasks.rewards import MODEL_PREFIX, GroupRewardFn, RewardError
from posttrain.types import StopReason

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class RewardModelConfig:
    """`[reward_model]`: how `[data] reward = "model:PATH"` runs its model."""

    transform: Literal["sigmoid", "raw"] = option(
        "sigmoid", "a one-label model's score: sigmoid(logit), or the raw logit"
    )
    batch_size: int = option(16, "completions per forward pass", AT_LEAST_ONE)
    device: str | None = option(None, "cpu, cuda, cuda:1, ... (None: cuda when available)")
    max_length: int | None = option(
        None, "tokens per input; a longer one keeps its first tokens (None: no limit)", AT_LEAST_ONE
    )
    dtype: Literal["float32", "bfloat16", "float16"] = option(
        "float32", "the dtype the model runs in"
    )

    def __post_init__(self) -> None:
        from posttrain.trainer.config import check_field_types

        check_field_types(self)


class RewardModel:
    """A sequence-classification reward model in directory `path`; the keywords are
    `RewardModelConfig`'s (or give `config`). Loaded at the first score, once."""

    def __init__(
        self, path: str | Path, config: RewardModelConfig | None = None, /, **options: object
    ) -> None:
        if config is not None and options:
            raise TypeError("give a RewardModelConfig or its options as keywords, not both")
        self.config = config if config is not None else build_options(RewardModelConfig, options)
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise FileNotFoundError(
                f"reward model {str(self.path)!r} is not a model directory (no config.json): "
                "give a directory saved by save_pretrained, holding a sequence-classification model"
            )
        self._lock = threading.Lock()
        self._loaded: tuple[PreTrainedModel, PreTrainedTokenizerBase] | None = None

    @property
    def spec(self) -> str:
        return f"{MODEL_PREFIX}{self.path}"

    @property
    def group_reward(self) -> GroupRewardFn:
        """Each problem's completions in batches: the job scores a group in one call."""
        return self.score_problem_group

    async def reward(self, problem: Problem, completion: str, stop_reason: StopReason) -> float:
        return (await self.score_problem_group(problem, [completion], [stop_reason]))[0]

    async def score_problem_group(
        self, problem: Problem, completions: Sequence[str], stop_reasons: Sequence[StopReason]
    ) -> list[float]:
        del stop_reasons  # the model reads the text, cut or not
        return await self.score_group(problem.chat(), completions)

    async def score(self, prompt: Prompt, completion: str) -> float:
        """The model's score of one completion of `prompt` (a string or a chat)."""
        return (await self.score_group(prompt, [completion]))[0]

    async def score_group(self, prompt: Prompt, completions: Sequence[str]) -> list[float]:
        """The scores of completions of one prompt, in batches of `batch_size`."""
        return await asyncio.to_thread(self.score_texts_sync, chat_of(prompt), list(completions))

    def render(self, chat: list[dict[str, str]], completion: str) -> tuple[str, bool]:
        """The text the model reads, and whether to add the tokenizer's special tokens."""
        _, tokenizer = self._load()
        if getattr(tokenizer, "chat_template", None):
            turns = [*chat, {"role": "assistant", "content": completion}]
            text = tokenizer.apply_chat_template(turns, tokenize=False)
            return str(text), False
        return "\n".join([*(m["content"] for m in chat), completion]), True

    def score_texts_sync(self, chat: list[dict[str, str]], completions: list[str]) -> list[float]:
        """`score_group`, blocking (one batch at a time, across threads)."""
        import torch

        model, tokenizer = self._load()
        rendered = [self.render(chat, c) for c in completions]
        scores: list[float] = []
        size = self.config.batch_size
        with self._lock, torch.no_grad():
            for start in range(0, len(rendered), size):
                batch = rendered[start : start + size]
                inputs = tokenizer(
                    [text for text, _ in batch],
                    add_special_tokens=batch[0][1],
                    padding=True,
                    truncation=self.config.max_length is not None,
                    max_length=self.config.max_length,
                    return_tensors="pt",
                ).to(model.device)
                logits = model(**inputs).logits.float()
                scores += self._mapped(logits).tolist()
        return scores

    def _mapped(self, logits_BL: torch.Tensor) -> torch.Tensor:
        if logits_BL.shape[-1] == 2:
            return logits_BL.softmax(dim=-1)[:, 1]
        if self.config.transform == "sigmoid":
            return logits_BL[:, 0].sigmoid()
        return logits_BL[:, 0]

    def _load(self) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        with self._lock:
            if self._loaded is None:
                self._loaded = self._load_now()
            return self._loaded

    def _load_now(self) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        device = self.config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        tokenizer = AutoTokenizer.from_pretrained(self.path)
        model = AutoModelForSequenceClassification.from_pretrained(
            self.path, dtype=getattr(torch, self.config.dtype)
        )
        labels = int(model.config.num_labels)
        if labels not in (1, 2):
            raise RewardError(
                f"reward model {str(self.path)!r} has {labels} labels; a reward model has 1 "
                "(a score) or 2 (label 1's probability is the score)"
            )
        if tokenizer.pad_token is None:
            if tokenizer.eos_token is None:
                raise RewardError(
                    f"reward model {str(self.path)!r}: its tokenizer has no pad or EOS token to "
                    "pad a batch with; set tokenizer.pad_token and save it again"
                )
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "right"
        if model.config.pad_token_id is None:  # the head reads each row's last non-pad token
            model.config.pad_token_id = tokenizer.pad_token_id
        return model.to(device).eval(), tokenizer
