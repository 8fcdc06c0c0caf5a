"""Shared-prefix passes: grouping rows by their common leading tokens, packing groups into
micro-batches, and hidden states, logprobs and gradients equal to the unshared pass."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Qwen2Config, Qwen2ForCausalLM

from posttrain.algo.losses import LossConfig
from posttrain.engine.batching import pad_datums, padded_tokens, split_by_token_budget
from posttrain.engine.logprob_pass import adapters_disabled, target_logprobs
from posttrain.engine.shared_prefix import (
    PrefixGroup,
    common_prefix_length,
    decoder_hidden,
    find_prefix_groups,
    plan_micro_batches,
)
from posttrain.engine.worker import Worker, WorkerConfig
from posttrain.models.load import LoraSettings, apply_lora, causal_lm, load_hf_model
from posttrain.types import Datum, ModelInput

# fp32 tolerance: the shared pass computes the same sums in another order (attention over a
# cached prefix with masked padding keys, and the members' gradients summed through the expand
# that repeats the prefix's keys/values), so results differ by a few float32 roundings per
# layer. Measured up to 7e-7 relative on the small model's gradients, 3e-7 here.
REL_TOL = 2e-6
VOCAB = 256  # token ids drawn below it; the tiny model's byte-level vocabulary is larger


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# --- grouping -------------------------------------------------------------------------------

P = list(range(10, 22))  # a 12-token prompt
Q = list(range(40, 49))  # a 9-token prompt


def test_completions_of_one_prompt_share_it():
    rows = [[*P, 1, 2], [*P, 3], [*Q, 4, 5, 6], [*P, 7, 8, 9]]
    assert find_prefix_groups(rows, min_length=8) == [
        PrefixGroup((0, 1, 3), 12),
        PrefixGroup((2,), 0),  # alone: nothing to share
    ]


def test_a_group_keeps_the_prefix_all_its_rows_share():
    # Rows 0 and 1 share 13 tokens (prompt + a first sampled 5), row 2 only the 12 of the
    # prompt: three rows saving 2 x 12 = 24 tokens beat two rows saving 1 x 13.
    rows = [[*P, 5, 6], [*P, 5, 7], [*P, 8]]
    assert find_prefix_groups(rows, min_length=8) == [PrefixGroup((0, 1, 2), 12)]


def test_a_short_common_head_does_not_merge_groups_that_share_more():
    # A 4-token system prompt S, then two 12-token prompts, three completions each: merging all
    # six at 4 shared tokens would save 5 x 4 = 20; two groups at 16 save 2 x 2 x 16 = 64.
    system = [1, 2, 3, 4]
    rows = [system + P + [50 + i] for i in range(3)] + [
        system + Q + P[:3] + [60 + i] for i in range(3)
    ]
    assert find_prefix_groups(rows, min_length=4) == [
        PrefixGroup((0, 1, 2), 16),
        PrefixGroup((3, 4, 5), 16),
    ]


def test_every_row_keeps_a_token_of_its_own():
    # Row 0 is all prefix of row 1: sharing stops one token short of row 0's end.
    rows = [P, [*P, 1, 2]]
    assert find_prefix_groups(rows, min_length=8) == [PrefixGroup((0, 1), 11)]


def test_below_min_length_or_off_nothing_is_shared():
    rows = [[*P[:7], 1], [*P[:7], 2]]
    assert find_prefix_groups(rows, min_length=8) == [PrefixGroup((0,), 0), PrefixGroup((1,), 0)]
    assert find_prefix_groups([[*P, 1], [*P, 2]], min_length=0) == [
        PrefixGroup((0,), 0),
        PrefixGroup((1,), 0),
    ]
    with pytest.raises(ValueError, match="min_length must be >= 0"):
        find_prefix_groups(rows, min_length=-1)


token_rows = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=14)


@given(token_rows, st.integers(0, 4))
@settings(max_examples=200, deadline=None)
def test_groups_partition_rows_and_share_what_they_claim(rows, min_length):
    groups = find_prefix_groups(rows, min_length)
    assert sorted(r for g in groups for r in g.rows) == list(range(len(rows)))
    for group in groups:
        if not group.shared:
            assert group.length == 0
            continue
        assert group.length >= max(min_length, 1)
        first = rows[group.rows[0]]
        for r in group.rows:
            assert len(rows[r]) > group.length  # a token of its own
            assert common_prefix_length(rows[r], first) >= group.length


# --- micro-batches --------------------------------------------------------------------------


@given(st.lists(st.integers(1, 40), min_size=1, max_size=30), st.integers(1, 120))
@settings(max_examples=60, deadline=None)
def test_without_sharing_packing_is_longest_first_within_budget(lengths, budget):
    batches = plan_micro_batches([[0] * n for n in lengths], budget, 0)
    assert sorted(r for b in batches for r in b.rows) == list(range(len(lengths)))
    flat = [lengths[r] for b in batches for r in b.rows]
    assert flat == sorted(lengths, reverse=True)  # similar lengths share a micro-batch
    for b in batches:
        assert len(b.rows) * max(lengths[r] for r in b.rows) <= budget or len(b.rows) == 1


def test_longest_first_pads_less_than_call_order():
    # Call order pairs each 5 with a 1: [5, 1] and [1, 5], 2 x 5 + 2 x 5 = 20 tokens computed
    # for 12 real ones. Longest first: [5, 5] and [1, 1], 10 + 2 = 12, no padding at all.
    lengths = [5, 1, 1, 5]
    assert padded_tokens(lengths, split_by_token_budget(lengths, 10)) == 20
    rows = [m.rows for m in plan_micro_batches([[0] * n for n in lengths], 10, 0)]
    assert rows == [[0, 3], [1, 2]]
    assert padded_tokens(lengths, rows) == 12


def test_groups_stay_together_and_large_ones_are_cut():
    rows = [[*P, i, i] for i in range(4)] + [[*Q, 9]]
    # Group of 4 costs 12 + 4 x 2 = 20 tokens; the single Q row 10. Budget 30 fits both.
    (both,) = plan_micro_batches(rows, 30, 8)
    assert both.rows == [0, 1, 2, 3, 4]
    assert both.groups == [PrefixGroup((0, 1, 2, 3), 12), PrefixGroup((4,), 0)]
    # Budget 17: the group is cut in halves of 12 + 2 x 2 = 16, each still sharing.
    cut = plan_micro_batches(rows, 17, 8)
    assert [m.rows for m in cut] == [[0, 1], [2, 3], [4]]
    assert [m.groups[0] for m in cut[:2]] == [PrefixGroup((0, 1), 12)] * 2


# --- numerics on the tiny model ---------------------------------------------------------------


def rl_like_datums(vocab: int, seed: int = 0) -> list[Datum]:
    """Two prompts (15 and 9 tokens) with completions of different lengths, and a lone row."""
    gen = torch.Generator().manual_seed(seed)

    def ints(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    prompts = [ints(15), ints(9)]
    rows = [prompts[0] + ints(n) for n in (6, 3, 8)] + [prompts[1] + ints(n) for n in (5, 7)]
    rows.append(ints(11))
    out = []
    for tokens in rows:
        weights = torch.rand(len(tokens) - 1, generator=gen)
        out.append(
            Datum(
                ModelInput.from_ints(tokens[:-1]),
                {"target_tokens": tokens[1:], "weights": weights},
            )
        )
    return out


def lora_model(tiny_model_dir: Path) -> torch.nn.Module:
    model = apply_lora(load_hf_model(tiny_model_dir), LoraSettings(rank=4), seed=0)
    with torch.no_grad():  # B starts at 0; give the adapters a real effect and gradient
        gen = torch.Generator().manual_seed(1)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=gen))
    return model


def logprobs_and_grads(model, datums, groups):
    batch = pad_datums(datums)
    model.zero_grad()
    logp_BT, _ = target_logprobs(
        model,
        batch.input_ids_BT,
        batch.pad_mask_BT,
        batch.inputs["target_tokens"],
        chunk_size=7,
        prefix_groups=groups,
    )
    (logp_BT * batch.inputs["weights"]).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return logp_BT.detach() * batch.pad_mask_BT, grads


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_shared_pass_gives_the_unshared_logprobs_and_gradients(tiny_model_dir, kind):
    model = load_hf_model(tiny_model_dir) if kind == "full" else lora_model(tiny_model_dir)
    datums = rl_like_datums(VOCAB)
    groups = find_prefix_groups([d.model_input.to_ints() for d in datums], 8)
    assert [g.length for g in groups if g.shared] == [15, 9]  # both prompts shared
    logp, grads = logprobs_and_grads(model, datums, groups)
    logp_plain, grads_plain = logprobs_and_grads(model, datums, None)
    assert rel(logp, logp_plain) < REL_TOL
    assert rel(grads, grads_plain) < REL_TOL
    assert grads_plain.norm() > 0


def test_shared_pass_under_disabled_adapters_is_the_base_model(tiny_model_dir):
    model = lora_model(tiny_model_dir)
    base = load_hf_model(tiny_model_dir)
    datums = rl_like_datums(VOCAB, seed=3)
    groups = find_prefix_groups([d.model_input.to_ints() for d in datums], 8)
    batch = pad_datums(datums)
    with torch.no_grad(), adapters_disabled(model):
        shared = decoder_hidden(
            causal_lm(model).get_decoder(),  # pyright: ignore[reportCallIssue]
            batch.input_ids_BT,
            batch.pad_mask_BT,
            groups,
        )
    with torch.no_grad():
        plain = base.get_decoder()(
            input_ids=batch.input_ids_BT, attention_mask=batch.pad_mask_BT.long()
        ).last_hidden_state
    mask = batch.pad_mask_BT[..., None]
    assert rel(shared * mask, plain * mask) < REL_TOL


def test_groups_must_cover_every_row(tiny_model_dir):
    model = load_hf_model(tiny_model_dir)
    datums = rl_like_datums(VOCAB)
    batch = pad_datums(datums)
    with pytest.raises(ValueError, match="rows \\[5\\]"):
        decoder_hidden(
            model.get_decoder(),
            batch.input_ids_BT,
            batch.pad_mask_BT,
            [PrefixGroup((0, 1, 2), 15), PrefixGroup((3, 4), 9)],
        )


def test_a_sliding_window_model_runs_unshared():
    # A sliding-window cache crops keys, so the prefix cache cannot be reused as is: the pass
    # falls back to the plain one and gives exactly its result.
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=0,
    )
    model = Qwen2ForCausalLM(config).eval()
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6, 7, 8, 11, 12]])
    mask = torch.ones_like(ids, dtype=torch.float32)
    with torch.no_grad():
        shared = decoder_hidden(model.model, ids, mask, [PrefixGroup((0, 1), 8)])
        plain = model.model(input_ids=ids, attention_mask=mask.long()).last_hidden_state
    assert torch.equal(shared, plain)


def test_worker_gradients_do_not_depend_on_sharing(tiny_model_dir):
    datums = rl_like_datums(VOCAB, seed=5)
    grads = {}
    for min_shared in (8, 0):
        worker = Worker(load_hf_model(tiny_model_dir), WorkerConfig(min_shared_prefix=min_shared))
        out = worker.forward_backward(datums, "cross_entropy", LossConfig())
        flat = torch.cat([g.flatten() for g in worker.grads().values() if g is not None])
        grads[min_shared] = (out.loss_sum, flat)
    (loss_shared, g_shared), (loss_plain, g_plain) = grads[8], grads[0]
    assert abs(loss_shared - loss_plain) <= REL_TOL * abs(loss_plain)
    assert rel(g_shared, g_plain) < REL_TOL


def test_shared_pass_gradients_are_bit_identical_at_two_threads(tiny_model_dir):
    # The prefix's keys/values are repeated for the rows that share it. Indexing did that
    # before; its backward accumulates with parallel atomic float adds on CPU once torch has
    # more than one thread and the tensor has >= 32768 elements (ATen's GRAIN_SIZE), and when
    # the threads' halves of the rows meet inside one group, both add into that group's
    # prefix in a racing order: gradients changed from call to call. One 48-token prompt with
    # 40 completions: the repeated keys of one layer hold 40 x 2 heads x 48 x 16 = 61440
    # elements. (Failed in 5 of 5 repeats with indexing.)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, VOCAB, (48,), generator=gen).tolist()
    rows = [prompt + torch.randint(3, VOCAB, (6,), generator=gen).tolist() for _ in range(40)]
    datums = [
        Datum(ModelInput.from_ints(r[:-1]), {"target_tokens": r[1:], "weights": [1.0] * 53})
        for r in rows
    ]
    worker = Worker(load_hf_model(tiny_model_dir), WorkerConfig(min_shared_prefix=8))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = []
        for _ in range(4):
            worker.forward_backward(datums, "cross_entropy", LossConfig())
            runs.append({n: g.clone() for n, g in worker.grads().items() if g is not None})
            worker.zero_grad()
    finally:
        torch.set_num_threads(threads)
    for run in runs[1:]:
        assert all(torch.equal(run[n], runs[0][n]) for n in runs[0])
