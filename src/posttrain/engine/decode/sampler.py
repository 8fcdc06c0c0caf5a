"""Batched sampling with a KV cache over a transformers causal LM, plain or PEFT-wrapped (LoRA).

Every step runs the model's own forward (PEFT's LoRA forward included), so sampling always uses
the current weights: adapters are never merged or unmerged, and nothing drifts.

Logprobs. Each sampled token reports its logprob under the distribution it was drawn from before
truncation, log_softmax(logits / temperature) over the full vocabulary (log_softmax(logits) for
greedy, temperature 0). min-p / top-k / top-p truncation and the repetition, presence and
frequency penalties are not folded in, as in vLLM's default, so the values equal a
teacher-forced forward pass at the same temperature.

Entropies (`SamplingParams.entropies`). Each sampled token's Shannon entropy, in nats, of the
same distribution as its logprob: softmax(logits / temperature) over the full vocabulary before
truncation (softmax(logits) for greedy). Computed per decode step from that step's logits,
a chunk of rows at a time (`engine.decode.entropy`), so never a [tokens, vocab] tensor at once.

Seeds. Sequence j of prompt i draws from its own generator seeded by (seed, i, j), one uniform per
step (inverse-CDF sampling), so a seeded sequence depends neither on the other prompts in the
batch (nor their lengths) nor on num_samples. `seed=None` draws a fresh seed.

Stops. `SamplingParams.stop=None` stops at EOS, or at the chat template's end-of-turn token where
that is another token (`tokenizer.end_of_turn_id`: a Qwen2.5 base model's `<|im_end|>` beside its
EOS `<|endoftext|>`); an explicit `stop` replaces them (`[]` never stops early). The returned tokens include the EOS / stop token, or the tokens that completed a stop
string (searched in the generated text only, special tokens as text). A sequence ends with
stop_reason "length" after `max_tokens`, or when the model's positions run out (`max_tokens=None`
samples up to that point).
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase
from transformers.cache_utils import Cache

from posttrain.engine.decode.entropy import sampling_entropies
from posttrain.engine.decode.kv_cache import (
    cache_keyword,
    preallocated_cache,
    repeat_rows,
    select_rows,
)
from posttrain.engine.decode.multi_lora import MultiLora
from posttrain.engine.decode.token_draw import TokenCounts, draw_tokens, scaled_logits
from posttrain.engine.logprob_pass import target_logprobs
from posttrain.tokenizer import end_of_turn_id
from posttrain.types import SampledSequence, SampleResponse, SamplingParams

# Uniforms drawn per generator at a time. Fixed, so a seed always yields the same stream.
_RNG_CHUNK = 64


class Sampler:
    """Samples from `model` with a KV cache; see the module docstring for logprobs and seeds."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_positions: int | None = None,
    ) -> None:
        config = getattr(model, "config")  # noqa: B009 - nn.Module's stubs hide HF's config
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = int(config.vocab_size)
        self.max_positions = int(max_positions or config.max_position_embeddings)
        if self.max_positions < 2:
            raise ValueError(f"max_positions must be >= 2, got {self.max_positions}")
        self.eos_ids = _stop_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if isinstance(pad, int) else (self.eos_ids or [0])[0]

    def sample(
        self,
        prompts: Sequence[Sequence[int]],
        num_samples: int,
        params: SamplingParams,
        *,
        include_prompt_logprobs: bool = False,
        first_index: int = 0,
    ) -> list[SampleResponse]:
        """`num_samples` completions of each prompt, all decoded in one batch.

        `first_index` is the index of `prompts[0]` in the caller's whole batch: seeds use
        (seed, first_index + i, j), so a batch split across workers samples what it would unsplit.
        """
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if first_index < 0:
            raise ValueError(f"first_index must be >= 0, got {first_index}")
        if len(prompts) == 0:
            raise ValueError("prompts is empty: give at least one prompt")
        rows = [self._check_prompt(p, f"prompts[{i}]", room=1) for i, p in enumerate(prompts)]
        room = [self.max_positions - len(row) for row in rows]
        limits = [min(r, params.max_tokens or r) for r in room]
        seed = secrets.randbits(63) if params.seed is None else params.seed
        with _eval_mode(self.model), torch.inference_mode():
            seeds = [
                _sequence_seed(seed, first_index + i, j)
                for i in range(len(rows))
                for j in range(num_samples)
            ]
            out = self._generate(rows, num_samples, params, limits, seeds)
        responses = out.responses(len(rows), num_samples)
        if not include_prompt_logprobs:
            return responses
        return [
            SampleResponse(r.sequences, self.compute_logprobs(row))
            for r, row in zip(responses, rows, strict=True)
        ]

    def sample_batched(
        self,
        requests: Sequence[SampleRequest],
        num_samples: int,
        adapters: MultiLora | None = None,
    ) -> list[list[SampleResponse]]:
        """Several requests decoded in one batch; each gets what `sample` gives it alone.

        Request r samples with its own seed (sequence j of its prompt i draws from
        (seed_r, i, j), as alone; seed None draws a fresh one per request), its own
        max_tokens, and, with `adapters` (built on this sampler's model as the host), the
        adapter of its slot. The other sampling settings must be the same for all requests.
        """
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if not requests:
            raise ValueError("requests is empty: give at least one request")
        shared = replace(requests[0].params, seed=None, max_tokens=None)
        for k, request in enumerate(requests):
            if replace(request.params, seed=None, max_tokens=None) != shared:
                raise ValueError(
                    f"requests[{k}] has other sampling settings than requests[0]; one batch "
                    "shares all but seed and max_tokens"
                )
            if not request.prompts:
                raise ValueError(f"requests[{k}] has no prompts: give at least one")
            if adapters is None and request.slot != 0:
                raise ValueError(f"requests[{k}] has slot {request.slot} but no adapters given")
        rows: list[list[int]] = []
        limits: list[int] = []
        seeds: list[int] = []
        slots: list[int] = []
        for k, request in enumerate(requests):
            seed = secrets.randbits(63) if request.params.seed is None else request.params.seed
            for i, prompt in enumerate(request.prompts):
                row = self._check_prompt(prompt, f"requests[{k}].prompts[{i}]", room=1)
                room = self.max_positions - len(row)
                rows.append(row)
                limits.append(min(room, request.params.max_tokens or room))
                seeds += [_sequence_seed(seed, i, j) for j in range(num_samples)]
                slots.append(request.slot)
        device = _device(self.model)
        row_slots = None if adapters is None else _RowSlots(adapters, slots, num_samples, device)
        patched = adapters.patched() if adapters is not None else contextlib.nullcontext()
        with _eval_mode(self.model), torch.inference_mode(), patched:
            out = self._generate(rows, num_samples, shared, limits, seeds, row_slots)
        flat = out.responses(len(rows), num_samples)
        responses: list[list[SampleResponse]] = []
        for request in requests:
            responses.append(flat[: len(request.prompts)])
            flat = flat[len(request.prompts) :]
        return responses

    def compute_logprobs(self, prompt: Sequence[int]) -> list[float | None]:
        """log p(prompt[t] | prompt[:t]) for each position; None at position 0 (no prefix)."""
        tokens = self._check_prompt(prompt, "prompt", room=0)
        if len(tokens) == 1:
            return [None]
        ids_1T = torch.tensor([tokens], device=_device(self.model))
        with _eval_mode(self.model), torch.inference_mode():
            logp_1T, _ = target_logprobs(
                self.model,
                ids_1T[:, :-1],
                torch.ones_like(ids_1T[:, :-1]),
                ids_1T[:, 1:],
                chunk_size=1024,
            )
        return [None, *logp_1T[0].float().tolist()]

    def _check_prompt(self, prompt: Sequence[int], name: str, *, room: int) -> list[int]:
        if isinstance(prompt, int | str):
            raise ValueError(f"{name} must be a sequence of token ids, got {type(prompt).__name__}")
        tokens = [int(t) for t in prompt]
        if not tokens:
            raise ValueError(f"{name} is empty: a prompt needs at least one token")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"{name} has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
            )
        if len(tokens) + room > self.max_positions:
            raise ValueError(
                f"{name} has {len(tokens)} tokens; the model's max_positions={self.max_positions} "
                f"allows at most {self.max_positions - room}"
            )
        return tokens

    def _generate(
        self,
        rows: list[list[int]],
        num_samples: int,
        params: SamplingParams,
        limits: list[int],
        seeds: list[int],
        row_slots: _RowSlots | None = None,
    ) -> _Outputs:
        device = _device(self.model)
        stops = _Stops.build(params, self.eos_ids, device)
        if row_slots is not None:
            row_slots.use_prompts()
        batch, logits_AV, cache = self._prefill(rows, num_samples, limits, device)
        out = _Outputs.empty(batch.rows_A.numel(), max(limits), device, params.entropies)
        uniforms = _Uniforms(seeds, device) if params.temperature > 0 else None
        counts = TokenCounts.build(rows, num_samples, logits_AV.shape[-1], params, device)
        for step in range(max(limits)):
            u_A = uniforms.at(step, batch.rows_A) if uniforms is not None else None
            scaled_AV = scaled_logits(logits_AV, params, u_A)
            penalized_AV = None
            if counts is not None:
                penalized = counts.penalize(logits_AV, batch.rows_A, params)
                penalized_AV = scaled_logits(penalized, params, u_A)
            tokens_A, logp_A = draw_tokens(scaled_AV, params, u_A, penalized_AV)
            if counts is not None:
                counts.add(batch.rows_A, tokens_A)
            h_A = sampling_entropies(scaled_AV) if params.entropies else None
            out.write(batch.rows_A, step, tokens_A, logp_A, h_A)
            hit_A = stops.hit(tokens_A, out, batch.rows_A, step, self.tokenizer)
            done_A = hit_A | (step + 1 >= batch.limit_A)
            if bool(done_A.any()):
                out.finish(batch.rows_A[done_A], step + 1, hit_A[done_A])
                # Finished rows leave the batch (and the KV cache): they cost no more compute.
                keep_A = (~done_A).nonzero().squeeze(1)
                if keep_A.numel() == 0:
                    break
                batch = batch.select(keep_A)
                select_rows(cache, keep_A)
                tokens_A = tokens_A[keep_A]
            if row_slots is not None:
                row_slots.use_rows(batch.rows_A)  # follows the rows through compaction
            logits_AV = self._decode(batch, tokens_A, step, cache)
        return out

    def _prefill(
        self, rows: list[list[int]], num_samples: int, limits: list[int], device: torch.device
    ) -> tuple[_Batch, torch.Tensor, Cache]:
        """Run the left-padded prompts once and repeat the cache for the samples."""
        width = max(len(row) for row in rows)
        ids_PL = torch.tensor([[self.pad_id] * (width - len(r)) + r for r in rows], device=device)
        mask_PL = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        # Real tokens sit at positions 0..len-1 whatever the padding, as in teacher forcing.
        pos_PL = (mask_PL.cumsum(-1) - 1).clamp(min=0)
        padded = bool((mask_PL == 0).any())
        cache = preallocated_cache(self.model, width + max(limits))
        out = self.model(
            input_ids=ids_PL,
            attention_mask=mask_PL if padded else None,
            position_ids=pos_PL,
            **{cache_keyword(self.model): cache},
            use_cache=True,
            # The last position as an index, not `logits_to_keep=1`: HF slices [:, -1:], a
            # non-contiguous [P, 1, H] view that torch's linear runs as a bmm on a copy of
            # lm_head's weight expanded P times (at 0.5B in bf16: 2.2 GB copied, 4.3 s per
            # call). Indexing gives a contiguous [P, 1, H] and a plain matmul.
            logits_to_keep=torch.tensor([width - 1], device=device),
        )
        if num_samples > 1:
            repeat_rows(cache, num_samples)
        mask_AX = None
        if padded:
            new_PX = torch.ones(len(rows), max(limits), dtype=mask_PL.dtype, device=device)
            mask_AX = torch.cat([mask_PL, new_PX], dim=1).repeat_interleave(num_samples, 0)
        batch = _Batch(
            rows_A=torch.arange(len(rows) * num_samples, device=device),
            pos_A=mask_PL.sum(-1).repeat_interleave(num_samples),
            limit_A=torch.tensor(limits, device=device).repeat_interleave(num_samples),
            mask_AX=mask_AX,
            prompt_width=width,
        )
        return batch, out.logits[:, -1].float().repeat_interleave(num_samples, 0), cache

    def _decode(
        self, batch: _Batch, tokens_A: torch.Tensor, step: int, cache: Cache
    ) -> torch.Tensor:
        """Feed the tokens sampled at `step`; return the next logits [A, V]."""
        mask = None
        if batch.mask_AX is not None:
            mask = batch.mask_AX[:, : batch.prompt_width + step + 1]
        out = self.model(
            input_ids=tokens_A[:, None],
            attention_mask=mask,
            position_ids=(batch.pos_A + step)[:, None],
            **{cache_keyword(self.model): cache},
            use_cache=True,
        )
        return out.logits[:, -1].float()


@dataclass(frozen=True)
class SampleRequest:
    """One request of `Sampler.sample_batched`: its prompts, its sampling settings (its own
    seed and max_tokens; the rest as the batch's), and the adapter slot it samples with."""

    prompts: Sequence[Sequence[int]]
    params: SamplingParams
    slot: int = 0


class _RowSlots:
    """The adapter slot of each prompt (prefill) and of each output row (decode)."""

    def __init__(
        self, adapters: MultiLora, slots: list[int], num_samples: int, device: torch.device
    ) -> None:
        self.adapters = adapters
        self.slot_P = torch.tensor(slots, dtype=torch.long, device=device)
        self.slot_B = self.slot_P.repeat_interleave(num_samples)

    def use_prompts(self) -> None:
        self.adapters.use(self.slot_P)

    def use_rows(self, rows_A: torch.Tensor) -> None:
        self.adapters.use(self.slot_B[rows_A])


@dataclass(frozen=True)
class _Batch:
    """The rows still decoding: their output row, next position, token limit, attention mask."""

    rows_A: torch.Tensor
    pos_A: torch.Tensor
    limit_A: torch.Tensor
    mask_AX: torch.Tensor | None
    prompt_width: int

    def select(self, keep_A: torch.Tensor) -> _Batch:
        mask = self.mask_AX[keep_A] if self.mask_AX is not None else None
        return _Batch(
            self.rows_A[keep_A], self.pos_A[keep_A], self.limit_A[keep_A], mask, self.prompt_width
        )


@dataclass(frozen=True)
class _Outputs:
    """Tokens, logprobs (and entropies, if asked) of every sequence (row), filled step by step;
    lengths when done."""

    tokens_BT: torch.Tensor
    logp_BT: torch.Tensor
    entropy_BT: torch.Tensor | None
    length_B: torch.Tensor
    stopped_B: torch.Tensor

    @classmethod
    def empty(cls, rows: int, steps: int, device: torch.device, entropies: bool) -> _Outputs:
        return cls(
            tokens_BT=torch.zeros(rows, steps, dtype=torch.long, device=device),
            logp_BT=torch.zeros(rows, steps, device=device),
            entropy_BT=torch.zeros(rows, steps, device=device) if entropies else None,
            length_B=torch.zeros(rows, dtype=torch.long, device=device),
            stopped_B=torch.zeros(rows, dtype=torch.bool, device=device),
        )

    def write(
        self,
        rows_A: torch.Tensor,
        step: int,
        tokens_A: torch.Tensor,
        logp_A: torch.Tensor,
        entropy_A: torch.Tensor | None,
    ) -> None:
        self.tokens_BT[rows_A, step] = tokens_A
        self.logp_BT[rows_A, step] = logp_A
        if self.entropy_BT is not None and entropy_A is not None:
            self.entropy_BT[rows_A, step] = entropy_A

    def finish(self, rows_D: torch.Tensor, length: int, stopped_D: torch.Tensor) -> None:
        self.length_B[rows_D] = length
        self.stopped_B[rows_D] = stopped_D

    def responses(self, num_prompts: int, num_samples: int) -> list[SampleResponse]:
        tokens, logps = self.tokens_BT.tolist(), self.logp_BT.tolist()
        entropies = None if self.entropy_BT is None else self.entropy_BT.tolist()
        lengths, stopped = self.length_B.tolist(), self.stopped_B.tolist()
        sequences = [
            SampledSequence(
                stop_reason="stop" if stopped[b] else "length",
                tokens=tokens[b][: lengths[b]],
                logprobs=logps[b][: lengths[b]],
                entropies=None if entropies is None else entropies[b][: lengths[b]],
            )
            for b in range(num_prompts * num_samples)
        ]
        return [
            SampleResponse(sequences[i * num_samples : (i + 1) * num_samples])
            for i in range(num_prompts)
        ]


@dataclass(frozen=True)
class _Stops:
    """Stop token ids and stop strings of one `sample` call."""

    token_ids: torch.Tensor
    strings: tuple[str, ...]
    window: int  # generated tokens decoded when looking for a stop string

    @classmethod
    def build(cls, params: SamplingParams, eos_ids: list[int], device: torch.device) -> _Stops:
        ids = eos_ids if params.stop is None else list(params.stop_tokens())
        strings = params.stop_strings()
        # A character is at most 4 byte-level tokens; +4 covers a partial character at the edge.
        window = 4 * max((len(s) for s in strings), default=0) + 4
        return cls(torch.tensor(ids, dtype=torch.long, device=device), strings, window)

    def hit(
        self,
        tokens_A: torch.Tensor,
        out: _Outputs,
        rows_A: torch.Tensor,
        step: int,
        tokenizer: PreTrainedTokenizerBase,
    ) -> torch.Tensor:
        """Whether each row's newest token is a stop token or completes a stop string."""
        hit_A = torch.isin(tokens_A, self.token_ids)
        if not self.strings:
            return hit_A
        # Checked every step, so a stop string can only newly appear at the end of the text.
        start = max(0, step + 1 - self.window)
        for a, row in enumerate(rows_A.tolist()):
            if not hit_A[a]:
                tail = out.tokens_BT[row, start : step + 1].tolist()
                text = tokenizer.decode(tail, skip_special_tokens=False)
                hit_A[a] = any(s in text for s in self.strings)
        return hit_A


class _Uniforms:
    """One torch.Generator per sequence, read `_RNG_CHUNK` uniforms at a time."""

    def __init__(self, seeds: list[int], device: torch.device) -> None:
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]
        self.buffer_BC = torch.zeros(len(seeds), _RNG_CHUNK, dtype=torch.float64)
        self.device = device

    def at(self, step: int, rows_A: torch.Tensor) -> torch.Tensor:
        rows = rows_A.cpu()
        if step % _RNG_CHUNK == 0:
            for row in rows.tolist():
                self.buffer_BC[row] = torch.rand(
                    _RNG_CHUNK, generator=self.generators[row], dtype=torch.float64
                )
        return self.buffer_BC[rows, step % _RNG_CHUNK].to(self.device)


def _sequence_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """A 64-bit generator seed for sequence (prompt_index, sample_index) under `seed`."""
    key = f"{seed}:{prompt_index}:{sample_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def _stop_ids(model: nn.Module, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """EOS ids from the tokenizer and the model's generation config (int or list), and the chat
    template's end-of-turn token."""
    end_of_turn = end_of_turn_id(tokenizer)
    ids: set[int] = set() if end_of_turn is None else {end_of_turn}
    generation_config = getattr(model, "generation_config", None)
    for value in (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return sorted(ids)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Sample without dropout (LoRA's included), then restore the caller's mode."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
