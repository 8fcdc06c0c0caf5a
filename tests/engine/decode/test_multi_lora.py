"""Per-row adapters in one forward (`engine.decode.multi_lora`) and batched sampling across adapters
(`Sampler.sample_batched`).

Models: three LoRA clients of the tiny base (ranks 4, 8, 16, different seeds, each trained two
steps on its own data so B != 0 and the adapters differ) and the base model alone, each loaded
separately (equal base weights in separate storage, which the base check must accept).

Tolerance: everything is float32. A batched row and the same row alone differ only in the
summation order of the matmuls (bmm over a zero-padded rank against PEFT's two linears; the
batch's left padding and shape against the lone row's), so logprobs move by ~1e-6, as in
tests/engine/decode/test_sampler.py, whose ATOL (1e-5) is reused; a wrong adapter or row moves them
by >= 1e-3 here (asserted below: the adapters change the logits by more than that).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from posttrain import Datum, ModelInput
from posttrain.clients.create import create_training_client
from posttrain.clients.local import LocalTrainingClient
from posttrain.engine.decode.multi_lora import MultiLora, check_same_base
from posttrain.engine.decode.sampler import SampleRequest
from posttrain.engine.worker import Worker
from posttrain.models.load import LoraSettings, apply_lora, load_hf_model
from posttrain.models.tiny import make_tiny_model
from posttrain.types import AdamParams, SamplingParams

ATOL = 1e-5  # see the module docstring
PROMPTS = [[256, 72, 105, 33], [7, 8], [256, 10, 20, 30, 40, 50, 60], [9, 90, 19]]


def train_two_steps(client: LocalTrainingClient, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(2):
        ids = torch.randint(3, 250, (4, 17), generator=gen)
        data = [
            Datum(
                ModelInput.from_ints(row[:-1].tolist()),
                {"target_tokens": row[1:], "weights": torch.ones(16)},
            )
            for row in ids
        ]
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(AdamParams(learning_rate=2e-2)).result()


def worker_of(client: LocalTrainingClient) -> Worker:
    worker = client.sampling_worker()
    assert worker is not None
    return worker


@pytest.fixture(scope="module")
def workers(tiny_model_dir: Path) -> Iterator[list[Worker]]:
    """Slots 0-2: LoRA ranks 4, 8, 16 (trained); slot 3: the base model."""
    yield from trained_and_base(tiny_model_dir, [(1, 4), (2, 8), (3, 16)])


def trained_and_base(
    model_dir: Path, seeds_and_ranks: list[tuple[int, int]], train_unembed: bool | None = None
) -> Iterator[list[Worker]]:
    """Workers of LoRA clients (seed, rank), each trained two steps, then of the base model."""
    clients = []
    for seed, rank in seeds_and_ranks:
        client = create_training_client(
            model_dir, lora_rank=rank, seed=seed, train_unembed=train_unembed, device="cpu"
        )
        train_two_steps(client, seed)
        clients.append(client)
    clients.append(create_training_client(model_dir, lora_rank=None, device="cpu"))
    yield [worker_of(c) for c in clients]
    for client in clients:
        client.close()


def models(workers: list[Worker]) -> list[nn.Module]:
    return [w.model for w in workers]


def test_adapters_differ_enough_to_catch_a_wrong_slot(workers: list[Worker]) -> None:
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        logits = [m(input_ids=ids).logits.log_softmax(-1) for m in models(workers)]
    for i in range(len(logits)):
        for j in range(i):
            assert (logits[i] - logits[j]).abs().max() > 1e-3


def test_gathered_forward_equals_each_models_own(workers: list[Worker]) -> None:
    host, ms = workers[0].model, models(workers)
    width = max(len(p) for p in PROMPTS)
    ids = torch.tensor([p + [0] * (width - len(p)) for p in PROMPTS])  # right-padded
    slots = torch.tensor([2, 0, 3, 1])  # every slot, not in order
    gathered = MultiLora(host, ms)
    with torch.no_grad(), gathered.patched():
        gathered.use(slots)
        batched = host(input_ids=ids).logits.log_softmax(-1)
    with torch.no_grad():
        for b, prompt in enumerate(PROMPTS):
            alone = ms[int(slots[b])](input_ids=torch.tensor([prompt])).logits.log_softmax(-1)
            torch.testing.assert_close(batched[b, : len(prompt)], alone[0], atol=ATOL, rtol=0)
    # Outside the context the host is itself again.
    assert not any("forward" in vars(layer) for layer in gathered.layers.values())


def test_gathered_forward_is_differentiable_per_adapter(workers: list[Worker]) -> None:
    host, ms = workers[0].model, models(workers)
    gathered = MultiLora(host, ms)
    ids = torch.tensor([PROMPTS[0], PROMPTS[0]])
    with gathered.patched():
        gathered.use(torch.tensor([0, 1]))
        host(input_ids=ids).logits.sum().backward()
    for slot in (0, 1):
        grads = [p.grad for n, p in ms[slot].named_parameters() if "lora_B" in n]
        assert grads and all(g is not None and bool(g.abs().sum() > 0) for g in grads)
    third = [p.grad for n, p in ms[2].named_parameters() if "lora_B" in n]
    assert all(g is None or not bool(g.any()) for g in third)  # slot 2 had no row
    for m in ms:
        m.zero_grad(set_to_none=True)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, stop=[]),
        SamplingParams(temperature=1.0, stop=[]),
        SamplingParams(temperature=0.7, top_k=50),  # stops at EOS: rows end at different steps
    ],
    ids=["greedy", "seeded", "eos-stops"],
)
def test_batched_sampling_equals_each_request_alone(
    workers: list[Worker], params: SamplingParams
) -> None:
    # Five requests (slot 0 twice), each its own max_tokens (rows leave the batch at different
    # steps, so the slots must follow the compaction) and seed.
    plan = [(0, PROMPTS[0], 3), (2, PROMPTS[1], 9), (3, PROMPTS[2], 5), (1, PROMPTS[3], 12)]
    plan.append((0, PROMPTS[1], 7))
    requests = [
        SampleRequest([prompt], replace(params, max_tokens=limit, seed=100 + k), slot)
        for k, (slot, prompt, limit) in enumerate(plan)
    ]
    host_sampler = workers[0].sampler()
    gathered = MultiLora(workers[0].model, models(workers))
    batched = host_sampler.sample_batched(requests, 2, gathered)
    for request, responses in zip(requests, batched, strict=True):
        (response,) = responses
        own = workers[request.slot].sampler().sample(request.prompts, 2, request.params)[0]
        for got, want in zip(response.sequences, own.sequences, strict=True):
            assert got.tokens == want.tokens
            assert got.stop_reason == want.stop_reason
            assert got.logprobs is not None and want.logprobs is not None
            assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)) <= ATOL


def test_unseeded_requests_draw_their_own_seeds(workers: list[Worker]) -> None:
    params = SamplingParams(temperature=1.0, stop=[], max_tokens=12)
    requests = [SampleRequest([PROMPTS[0]], params), SampleRequest([PROMPTS[0]], params)]
    first, second = workers[3].sampler().sample_batched(requests, 1)
    assert first[0].sequences[0].tokens != second[0].sequences[0].tokens


def test_sample_batched_refuses_mixed_settings(workers: list[Worker]) -> None:
    requests = [
        SampleRequest([PROMPTS[0]], SamplingParams(temperature=0.0)),
        SampleRequest([PROMPTS[0]], SamplingParams(temperature=1.0)),
    ]
    with pytest.raises(ValueError, match=r"requests\[1\] has other sampling settings"):
        workers[0].sampler().sample_batched(requests, 1)
    with pytest.raises(ValueError, match="slot 2 but no adapters"):
        workers[0].sampler().sample_batched([SampleRequest([[1]], SamplingParams(), 2)], 1)


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def toy_lora(
    base: Toy, rank: int, alpha: int, A: list[list[float]], B: list[list[float]]
) -> nn.Module:
    model = get_peft_model(
        copy.deepcopy(base), LoraConfig(r=rank, lora_alpha=alpha, target_modules=["proj"])
    )
    layer: Any = model.get_submodule("base_model.model.proj")
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(torch.tensor(A))
        layer.lora_B["default"].weight.copy_(torch.tensor(B))
    return model


def test_gather_on_a_one_layer_toy_by_hand() -> None:
    base = Toy()
    with torch.no_grad():
        base.proj.weight.copy_(torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))  # W x = x[:2]
    # Slot 0: rank 1, alpha 2 (scale 2); slot 1: rank 2, alpha 2 (scale 1); slot 2: the base.
    host = toy_lora(base, 1, 2, [[1.0, 1.0, 1.0]], [[1.0], [2.0]])
    other = toy_lora(base, 2, 2, [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]], [[1.0, 0.0], [0.0, -1.0]])
    gathered = MultiLora(host, [host, other, base])
    x = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [0.0, 1.0, 0.0]])
    with torch.no_grad(), gathered.patched():
        gathered.use(torch.tensor([0, 1, 2, 1]))
        y = host(x)
    expected = [
        [13.0, 26.0],  # W x = [1, 2]; A x = 6; B (A x) = [6, 12]; times 2: [12, 24]
        [2.0, -1.0],  # A x = [1, 3]; B (A x) = [1, -3]; times 1
        [1.0, 2.0],  # the base alone
        [0.0, 1.0],  # A x = [0, 0]: nothing added
    ]
    assert y.tolist() == expected


def test_refuses_dora_and_dropout() -> None:
    base = Toy()
    dora = get_peft_model(
        copy.deepcopy(base), LoraConfig(r=1, target_modules=["proj"], use_dora=True)
    )
    drop = get_peft_model(
        copy.deepcopy(base), LoraConfig(r=1, target_modules=["proj"], lora_dropout=0.1)
    )
    plain = get_peft_model(copy.deepcopy(base), LoraConfig(r=1, target_modules=["proj"]))
    with pytest.raises(ValueError, match="DoRA"):
        MultiLora(plain, [plain, dora])
    with pytest.raises(ValueError, match=r"dropout 0\.1"):
        MultiLora(plain, [drop])


def test_refuses_other_targets_and_other_base(
    workers: list[Worker], tiny_model_dir: Path, tied_model_dir: Path, tmp_path: Path
) -> None:
    host = workers[0].model
    attn_only = apply_lora(load_hf_model(tiny_model_dir), LoraSettings(4, train_mlp=False))
    with pytest.raises(ValueError, match="adapts other layers than the host"):
        MultiLora(host, [host, attn_only])
    other_base = apply_lora(
        load_hf_model(make_tiny_model(tmp_path / "seed1", seed=1)), LoraSettings(4)
    )
    with pytest.raises(ValueError, match=r"models\[1\] is not a model of the host's base"):
        MultiLora(host, [host, other_base])
    untied_unembedding = apply_lora(load_hf_model(tied_model_dir), LoraSettings(4))
    tied = apply_lora(load_hf_model(tied_model_dir), LoraSettings(4, train_unembed=True))
    with pytest.raises(ValueError, match="adapts other layers than the host"):
        MultiLora(tied, [tied, untied_unembedding])


def test_base_check_sees_a_changed_base_after_a_cached_pass(tiny_model_dir: Path) -> None:
    host = apply_lora(load_hf_model(tiny_model_dir), LoraSettings(4))
    copy_ = load_hf_model(tiny_model_dir)
    check_same_base(host, copy_, "copy")  # equal values, separate storage: passes, cached
    check_same_base(host, copy_, "copy")
    with torch.no_grad():
        copy_.model.norm.weight.add_(1.0)
    with pytest.raises(ValueError, match=r"its model\.norm\.weight differs"):
        check_same_base(host, copy_, "copy")


def test_gathered_forward_on_a_bf16_base_casts_as_peft_does(tiny_model_dir: Path) -> None:
    """fp32 adapters on a bf16 base: x goes to fp32 for the adapter, the sum back to bf16, as
    in PEFT. The two paths differ by fp32 summation order before the one rounding to bf16, so
    a rounding may flip by one bf16 step: held to test_bf16's bound, 2^-8 |logp| per token."""
    ms = [
        apply_lora(load_hf_model(tiny_model_dir, dtype="bfloat16"), LoraSettings(r), seed=r)
        for r in (4, 8)
    ]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in ms:
            for name, p in m.named_parameters():
                if "lora_B" in name:
                    assert p.dtype == torch.float32
                    p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    ids = torch.tensor([PROMPTS[0], PROMPTS[0]])
    gathered = MultiLora(ms[0], ms)
    with torch.no_grad(), gathered.patched():
        gathered.use(torch.tensor([1, 0]))
        out = ms[0](input_ids=ids).logits
    assert out.dtype == torch.bfloat16
    batched = out.float().log_softmax(-1)
    with torch.no_grad():
        for b, slot in enumerate([1, 0]):
            own = ms[slot](input_ids=ids[b : b + 1]).logits.float().log_softmax(-1)[0]
            assert ((batched[b] - own).abs() <= 2.0**-8 * own.abs()).all()


@pytest.fixture(scope="module")
def tied_workers(tied_model_dir: Path) -> Iterator[list[Worker]]:
    """The tinker SDK's default on a tied model (train_unembed=True: one adapter on the shared
    embedding matrix, which the unembedding uses transposed): ranks 4 and 8, trained, and the
    base model."""
    yield from trained_and_base(tied_model_dir, [(1, 4), (2, 8)], train_unembed=True)


def test_tied_embedding_adapters_gather_per_row(tied_workers: list[Worker]) -> None:
    host, ms = tied_workers[0].model, models(tied_workers)
    ids = torch.tensor([PROMPTS[0][:3], PROMPTS[3][:3], PROMPTS[2][:3]])
    with torch.no_grad():
        # The embedding adapters differ from each other enough to catch a wrong slot.
        logits = [m(input_ids=ids[:1]).logits for m in ms]
        assert (logits[0] - logits[1]).abs().max() > 1e-3
        assert (logits[0] - logits[2]).abs().max() > 1e-3
    gathered = MultiLora(host, ms)
    slots = torch.tensor([1, 2, 0])
    with torch.no_grad(), gathered.patched():
        gathered.use(slots)
        batched = host(input_ids=ids).logits.log_softmax(-1)
    with torch.no_grad():
        for b in range(3):
            alone = ms[int(slots[b])](input_ids=ids[b : b + 1]).logits.log_softmax(-1)
            torch.testing.assert_close(batched[b], alone[0], atol=ATOL, rtol=0)
    # Gradients reach the embedding adapter of a slot with rows.
    with gathered.patched():
        gathered.use(torch.tensor([0, 0, 2]))
        host(input_ids=ids).logits.sum().backward()
    embedding_grads = [p.grad for n, p in ms[0].named_parameters() if "lora_embedding" in n]
    assert embedding_grads and all(g is not None and bool(g.any()) for g in embedding_grads)
    for m in ms:
        m.zero_grad(set_to_none=True)


def test_tied_embedding_adapters_sample_as_alone(tied_workers: list[Worker]) -> None:
    params = SamplingParams(temperature=0.0, stop=[], max_tokens=6)
    requests = [
        SampleRequest([PROMPTS[0]], params, 1),
        SampleRequest([PROMPTS[1]], params, 0),
        SampleRequest([PROMPTS[2]], params, 2),
    ]
    gathered = MultiLora(tied_workers[0].model, models(tied_workers))
    batched = tied_workers[0].sampler().sample_batched(requests, 1, gathered)
    for request, responses in zip(requests, batched, strict=True):
        own = tied_workers[request.slot].sampler().sample(request.prompts, 1, params)[0]
        (got,), (want,) = responses[0].sequences, own.sequences
        assert got.tokens == want.tokens
        assert got.logprobs is not None and want.logprobs is not None
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)) <= ATOL
