"""The Tokenizer protocol: transformers' tokenizers satisfy it (pyright checks the assignments
below), a tokenizer with only its members drives the rollout code, and `as_tokenizer` names
what a wrong object lacks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from posttrain.engine.decode.sampler import Sampler
from posttrain.models.load import load_hf_model, load_tokenizer
from posttrain.models.tiny import CHAT_TEMPLATE, build_tokenizer
from posttrain.rollouts.builder import TrajectoryBuilder
from posttrain.server.openai_schema import eos_texts
from posttrain.tokenizer import (
    Tokenizer,
    TurnClosing,
    as_tokenizer,
    assistant_closing,
    end_of_turn_id,
    eos_token,
    eos_token_id,
    render_chat,
)
from posttrain.types import SampledSequence


def hf_tokenizers_are_tokenizers(base: PreTrainedTokenizerBase, fast: PreTrainedTokenizerFast):
    """Never called: pyright checks that each assignment type-checks."""
    a: Tokenizer = base
    b: Tokenizer = fast
    c: Tokenizer = build_tokenizer()
    d: Tokenizer = load_tokenizer("model-dir")
    return a, b, c, d


class LetterTokenizer:
    """A tokenizer with the protocol's members and nothing else: one token per character
    (its code point), 0 is the end of a turn. No eos_token attributes: they are optional."""

    END = 0

    @property
    def all_special_ids(self) -> list[int]:
        return [self.END]

    def encode(self, text: str, /, *, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int], /, *, skip_special_tokens: bool = False) -> str:
        return "".join(chr(t) for t in token_ids if t != self.END or not skip_special_tokens)

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        /,
        *,
        tools: list[dict[str, Any] | Any] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = True,
        **template_kwargs: Any,
    ) -> object:
        ids = [t for m in conversation for t in [*self.encode(f"{m['role']}:{m['content']}"), 0]]
        ids += self.encode("assistant:") if add_generation_prompt else []
        return ids if tokenize else self.decode(ids)


def test_a_tokenizer_with_only_the_protocol_drives_a_rollout():
    tok: Tokenizer = LetterTokenizer()
    # Renders of "a" and "b" end with the content's letter then 0: the closing is the end token.
    assert assistant_closing(tok) == TurnClosing(through_end=(0,), after_end=())
    builder = TrajectoryBuilder(tok)
    prompt = builder.prompt({"role": "user", "content": "hi"})
    assert prompt == [*map(ord, "user:hi"), 0, *map(ord, "assistant:")]
    sampled = SampledSequence("stop", [ord("y"), ord("o"), 0], [-0.5, -0.25, -0.125])
    assert builder.completion(sampled) == "yo"
    trajectory = builder.build(reward=1.0)
    assert trajectory.tokens == [*prompt, ord("y"), ord("o"), 0]
    assert trajectory.num_trainable_tokens == 3


def test_hf_tokenizers_pass_the_check_and_give_their_eos(tiny_model_dir: Path):
    for tok in (build_tokenizer(), load_tokenizer(tiny_model_dir)):
        assert as_tokenizer(tok) is tok
        # posttrain's tiny tokenizer: specials at 256..259, `<|eos|>` is 257 (models/tiny.py)
        assert (eos_token(tok), eos_token_id(tok)) == ("<|eos|>", 257)
    assert (eos_token(LetterTokenizer()), eos_token_id(LetterTokenizer())) == (None, None)


def test_a_wrong_tokenizer_is_named_with_what_it_lacks():
    with pytest.raises(
        TypeError,
        match=r"a str is not a tokenizer: it has no all_special_ids, apply_chat_template, "
        r"decode; give a transformers tokenizer",
    ):
        as_tokenizer("gpt2")


def test_the_end_of_turn_token_is_the_templates_special_closing_token(tiny_model_dir: Path):
    """`end_of_turn_id`: the sampler stops there as at EOS. posttrain's tiny template ends a
    turn with its EOS (257); one that ends it with `<|pad|>` (258, as a Qwen2.5 base model ends
    turns with `<|im_end|>` beside its EOS `<|endoftext|>`) makes the sampler stop at both."""
    assert end_of_turn_id(LetterTokenizer()) == LetterTokenizer.END
    tiny = build_tokenizer()
    assert end_of_turn_id(tiny) == 257
    tiny.chat_template = CHAT_TEMPLATE.replace("+ eos_token", "+ '<|pad|>'")
    assert end_of_turn_id(tiny) == 258
    assert Sampler(load_hf_model(tiny_model_dir), tiny).eos_ids == [257, 258]
    tiny.chat_template = CHAT_TEMPLATE.replace("+ eos_token", "+ '\\n'")  # no special token
    assert end_of_turn_id(tiny) is None
    tiny.chat_template = None  # no template: the plain-text format, whose turns end at EOS
    assert end_of_turn_id(tiny) == 257


def test_openai_stop_strings_join_the_end_of_turn_too():
    """With stop strings the server's sampler stops at them, EOS and the end of turn (an explicit
    `stop` replaces the sampler's default set), each as the text the sampler matches."""
    tiny = build_tokenizer()
    assert eos_texts(tiny) == ("<|eos|>",)
    tiny.chat_template = CHAT_TEMPLATE.replace("+ eos_token", "+ '<|pad|>'")
    assert eos_texts(tiny) == ("<|eos|>", "<|pad|>")


def test_a_tokenizer_without_a_chat_template_renders_plain_text():
    """A pretrained model's tokenizer (Gemma 3 270M's) has no template: BOS, the texts as they
    are, an assistant turn closed by EOS; a prompt ends where the model continues it."""
    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    bos, eos = int(tokenizer.bos_token_id), int(tokenizer.eos_token_id)  # pyright: ignore[reportArgumentType]
    question = [{"role": "user", "content": "Q: 1+1?\nA:"}]
    assert render_chat(tokenizer, question, True) == [bos, *b"Q: 1+1?\nA:"]
    turns = [{"role": "system", "content": "S"}, *question, {"role": "assistant", "content": " 2"}]
    assert render_chat(tokenizer, turns, False) == [bos, *b"S\nQ: 1+1?\nA: 2", eos]
    assert assistant_closing(tokenizer) == TurnClosing((eos,), ())
    builder = TrajectoryBuilder(tokenizer)
    assert builder.prompt(*question) == [bos, *b"Q: 1+1?\nA:"]
