import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.engine.batching import (
    pad_datums,
    shard_for_ranks,
    split_by_token_budget,
)
from posttrain.types import Datum, ModelInput


def datum(tokens, weights=None):
    weights = weights if weights is not None else [1.0] * len(tokens)
    return Datum(ModelInput.from_ints(tokens), {"target_tokens": tokens, "weights": weights})


def test_pad_datums_right_pads_with_zeros():
    batch = pad_datums([datum([5, 6, 7], [0.0, 1.0, 2.0]), datum([8])])
    assert batch.input_ids_BT.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch.pad_mask_BT.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.inputs["weights"].tolist() == [[0.0, 1.0, 2.0], [1.0, 0.0, 0.0]]
    assert batch.inputs["target_tokens"].dtype == torch.int64
    assert batch.num_tokens == 4


def test_pad_datums_rejects_mixed_keys():
    other = Datum(ModelInput.from_ints([1]), {"target_tokens": [1]})
    with pytest.raises(ValueError, match="same keys"):
        pad_datums([datum([1]), other])


@given(st.lists(st.integers(1, 40), min_size=1, max_size=30), st.integers(1, 120))
@settings(max_examples=60, deadline=None)
def test_token_budget_split_covers_all_in_order(lengths, budget):
    groups = split_by_token_budget(lengths, budget)
    assert [i for g in groups for i in g] == list(range(len(lengths)))
    for group in groups:
        padded = len(group) * max(lengths[i] for i in group)
        assert padded <= budget or len(group) == 1


@given(st.lists(st.integers(1, 40), min_size=0, max_size=30), st.integers(1, 5))
@settings(max_examples=60, deadline=None)
def test_shards_are_contiguous_and_cover(lengths, ranks):
    shards = shard_for_ranks(lengths, ranks)
    assert len(shards) == ranks
    assert [i for s in shards for i in s] == list(range(len(lengths)))


def test_shards_balance_tokens():
    # 8 datums of 10 tokens over 2 ranks: 40 tokens each.
    assert shard_for_ranks([10] * 8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # One long datum and small ones: the long one goes alone.
    assert shard_for_ranks([30, 5, 5, 5, 5, 5, 5], 2) == [[0], [1, 2, 3, 4, 5, 6]]
