"""`export_model` / `posttrain export`: a trained run as a Hugging Face model directory.

The trained model's logits are the worker's own forward on the trained weights; the export is
loaded with plain transformers (or PEFT on the base) and must give the same logits.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from local_groups import synthetic_groups
from posttrain.backends.export import PROVENANCE, export_model
from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.cli.main import main
from posttrain.engine.checkpoint import save_checkpoint
from posttrain.models.load import load_hf_model

TOKENS = torch.tensor([[5, 17, 99, 3, 42, 7, 250, 1]])
# fp32: the export holds W0 + s B A summed once; the worker computes W0 x + s B (A x). The two
# orders differ by a few ulps of each product, which reach the logits (|logit| < ~2) as a few
# 1e-7 (measured max below 5e-7); a wrong scale, a missed layer or a dropped lm_head adapter
# moves them by > 1e-3.
FP32_ATOL = 2e-6


def _train(base: Path, root: Path, steps: int = 2, **model_options: object):
    """A LocalBackend run of `steps` RL steps; returns (model directory, worker's logits)."""

    async def run() -> tuple[Path, torch.Tensor]:
        backend = LocalBackend(root)
        model = TrainableModel(name="m", project="p", base_model=str(base), **model_options)  # pyright: ignore[reportArgumentType]
        await model.register(backend)
        for step in range(steps):
            # A large learning rate, so the trained logits are far from the base's.
            await backend.train(model, synthetic_groups(step), learning_rate=1e-2)
        worker = backend.client(model).dispatch.executor.workers[0]  # pyright: ignore[reportAttributeAccessIssue]
        with torch.no_grad():
            logits = worker.model(input_ids=TOKENS).logits.clone()
        await backend.close()
        return model.directory, logits

    return asyncio.run(run())


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TOKENS).logits.float()


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    return _train(tiny_model_dir, tmp_path_factory.mktemp("lora"), lora_rank=4)


def test_merged_export_gives_the_trained_logits(lora_run, tiny_model_dir: Path, tmp_path: Path):
    model_dir, trained = lora_run
    result = export_model(model_dir.parent.parent, tmp_path / "out")  # the run dir, runs/p
    assert (result.step, result.form, result.dtype) == (2, "merged", "float32")
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", PROVENANCE} <= names
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= names
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    got = _logits(plain)
    gap = (got - trained).abs().max().item()
    print(f"merged fp32 max abs logits gap: {gap:.3g}")
    torch.testing.assert_close(got, trained, rtol=0, atol=FP32_ATOL)
    assert (got - _logits(load_hf_model(tiny_model_dir))).abs().max() > 1e-2  # it trained
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer.chat_template  # the chat template came along
    record = json.loads((tmp_path / "out" / PROVENANCE).read_text())
    assert record["step"] == 2 and record["form"] == "merged"
    assert record["untied_embeddings"] is False and record["source"] == str(model_dir)


def test_adapter_export_loads_with_peft(lora_run, tiny_model_dir: Path, tmp_path: Path):
    model_dir, trained = lora_run
    result = export_model(model_dir, tmp_path / "adapter", mode="adapter")
    assert result.form == "adapter"
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_model_dir.resolve())
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter")
    # The same modules and kernels as the worker's PEFT model: only summation order may differ.
    torch.testing.assert_close(_logits(peft_model), trained, rtol=0, atol=FP32_ATOL)
    assert (tmp_path / "adapter" / "tokenizer.json").is_file()
    # The test model's lm_head is a matrix of its own, adapted by default: PEFT merges it, but
    # vLLM's LoRA cannot load it, which the export says.
    assert len(result.notes) == 1 and "LoRA on lm_head, which vLLM" in result.notes[0]
    record = json.loads((tmp_path / "adapter" / PROVENANCE).read_text())
    assert record["notes"] == list(result.notes)


def test_an_export_has_the_umasks_modes(lora_run, tmp_path: Path, wrong_modes):
    # safetensors writes its file 0600 and mkdtemp its directory 0700, unreadable for the hub
    # client, server or container (another uid) the export is for.
    model_dir, _ = lora_run
    export_model(model_dir, tmp_path / "merged")
    export_model(model_dir, tmp_path / "adapter", mode="adapter")
    assert wrong_modes(tmp_path / "merged") == {}
    assert wrong_modes(tmp_path / "adapter") == {}


def test_bfloat16_export(lora_run, tmp_path: Path):
    model_dir, trained = lora_run
    export_model(model_dir, tmp_path / "bf16", dtype="bfloat16", step=2)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    assert next(plain.parameters()).dtype == torch.bfloat16
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    gap = (_logits(plain) - trained).abs().max().item()
    print(f"merged bf16 max abs logits gap: {gap:.3g}")
    # bf16 keeps 8 significant bits: each weight is rounded by up to 2^-9 relative, and the
    # forward runs in bf16 too; through two layers that reaches logits of magnitude ~2 as a few
    # 1e-3 (measured 5.3e-3). 3e-2 allows for that and is still far below what a wrong merge
    # (a missed layer, a wrong scale) moves (> 0.1 with this run's lr).
    assert gap < 3e-2
    assert gap > 0  # it is bf16, not the fp32 weights


def test_full_fine_tuning_run(tiny_model_dir: Path, tmp_path: Path):
    model_dir, trained = _train(tiny_model_dir, tmp_path / "runs", steps=1, lora_rank=None)
    result = export_model(model_dir, tmp_path / "out")
    assert result.form == "full"
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    # The same weights in the same modules: equal up to fp32 kernel order.
    torch.testing.assert_close(_logits(plain), trained, rtol=0, atol=FP32_ATOL)
    with pytest.raises(ValueError, match=r"full fine-tuning checkpoint.*without --adapter"):
        export_model(model_dir, tmp_path / "adapter", mode="adapter")
    assert not (tmp_path / "adapter").exists()


def test_tied_model_with_a_shared_adapter_stays_tied(tied_model_dir: Path, tmp_path: Path):
    # train_unembed=True on a tied model: one LoRA on the shared matrix, which PEFT saves twice
    # (the embedding's pair and lm_head's transposed copy); merged once, the export stays tied.
    model_dir, trained = _train(
        tied_model_dir, tmp_path / "runs", steps=1, lora_rank=4, train_unembed=True
    )
    result = export_model(model_dir, tmp_path / "out")
    assert not result.untied_embeddings and result.notes == ()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert plain.config.tie_word_embeddings
    torch.testing.assert_close(_logits(plain), trained, rtol=0, atol=FP32_ATOL)
    # As a PEFT adapter it would load right but merge wrong (PEFT 0.21's merge_and_unload adds
    # the delta for embed_tokens and again for the tied lm_head: 0.83 nats off on log-softmax
    # after 3 of these steps), and vLLM cannot load it: refused, naming the way out, with
    # nothing written.
    with pytest.raises(ValueError, match=r"model\.embed_tokens.*ties.*without --adapter"):
        export_model(model_dir, tmp_path / "adapter", mode="adapter")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "runs"]


def test_an_adapter_on_a_tied_lm_head_alone_unties(tied_model_dir: Path, tmp_path: Path):
    # Training changed lm_head apart from the embedding: the export must untie the two.
    peft_model = get_peft_model(
        load_hf_model(tied_model_dir), LoraConfig(r=2, lora_alpha=4, target_modules=["lm_head"])
    )
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(
                    torch.randn(param.shape, generator=torch.Generator().manual_seed(0)) * 0.1
                )
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    record = {"base_model": str(tied_model_dir), "lora_rank": 2}
    (model_dir / "model.json").write_text(json.dumps(record))
    save_checkpoint(model_dir / "checkpoints" / "1", model=peft_model)
    result = export_model(model_dir, tmp_path / "out")
    assert result.untied_embeddings and "unties" in result.notes[0]
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert not plain.config.tie_word_embeddings
    torch.testing.assert_close(_logits(plain), _logits(peft_model), rtol=0, atol=FP32_ATOL)
    # The embedding is the base's; only the written lm_head carries the adapter.
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    base = load_file(str(tied_model_dir / "model.safetensors"))
    assert torch.equal(saved["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    assert not torch.equal(saved["lm_head.weight"], base["model.embed_tokens.weight"])
    provenance = json.loads((tmp_path / "out" / PROVENANCE).read_text())
    assert provenance["untied_embeddings"] is True and provenance["notes"] == list(result.notes)
    # PEFT's merge of this adapter would change the embedding too (the one matrix): refused.
    with pytest.raises(ValueError, match=r"LoRA on lm_head.*ties"):
        export_model(model_dir, tmp_path / "adapter", mode="adapter")


def test_clear_errors_and_nothing_half_written(lora_run, tmp_path: Path):
    model_dir, _ = lora_run
    out = tmp_path / "out"
    with pytest.raises(
        ValueError, match=r"step 7 has no checkpoint .*steps with a checkpoint: 1, 2"
    ):
        export_model(model_dir, out, step=7)
    export_model(model_dir, out, step=1)
    with pytest.raises(FileExistsError, match="exists; pass --force"):
        export_model(model_dir, out)
    assert json.loads((out / PROVENANCE).read_text())["step"] == 1  # untouched
    export_model(model_dir, out, force=True)
    assert json.loads((out / PROVENANCE).read_text())["step"] == 2
    with pytest.raises(ValueError, match="holds the model being exported"):
        export_model(model_dir, model_dir.parent, force=True)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"not an export .*even with --force"):
        export_model(model_dir, tmp_path / "notes", force=True)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"
    shutil.rmtree(tmp_path / "notes")
    # A damaged checkpoint (a file shorter than its manifest says) is named, with the way out.
    copy = tmp_path / "copy"
    shutil.copytree(model_dir, copy)
    weights = copy / "checkpoints" / "2" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"step 2 is damaged: corrupt .*--step \(1\)"):
        export_model(copy, tmp_path / "damaged")
    # A failure while writing (the base model lost its weights) leaves no OUT_DIR, no debris.
    record = json.loads((copy / "model.json").read_text())
    empty_base = tmp_path / "empty_base"
    empty_base.mkdir()
    shutil.copy(Path(record["base_model"]) / "config.json", empty_base)
    (copy / "model.json").write_text(json.dumps({**record, "base_model": str(empty_base)}))
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        export_model(copy, tmp_path / "half", step=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy", "empty_base", "out"]


def test_a_run_with_several_models_asks_which(lora_run, tmp_path: Path):
    model_dir, _ = lora_run
    run = tmp_path / "run"
    shutil.copytree(model_dir, run / "models" / "a")
    shutil.copytree(model_dir, run / "models" / "b")
    with pytest.raises(ValueError, match=r"holds 2 models \(a, b\).*--model"):
        export_model(run, tmp_path / "out")
    assert export_model(run, tmp_path / "out", model="b").source == str(run / "models" / "b")


def test_the_command(lora_run, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    model_dir, _ = lora_run
    assert main(["export", str(model_dir), str(tmp_path / "out"), "--step", "1"]) == 0
    assert "exported step 1" in capsys.readouterr().out
    assert main(["export", str(model_dir), str(tmp_path / "out"), "--adapter"]) == 2
    assert "pass --force" in capsys.readouterr().err
    args = ["export", str(model_dir), str(tmp_path / "out"), "--adapter", "--force"]
    assert main([*args, "--dtype", "bfloat16"]) == 0
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
async def test_a_ray_fsdp2_run_exports_its_gathered_weights(
    ray_started, tiny_model_dir: Path, tmp_path: Path
):
    from posttrain.backends.ray import RayBackend
    from posttrain.engine.ray.executor import RayConfig
    from posttrain.models.load import apply_lora
    from posttrain.models.lora import LoraSettings

    config = RayConfig(collective_timeout_s=30.0, startup_timeout_s=180.0)
    backend = RayBackend(tmp_path / "ray", num_workers=2, ray_config=config, sharding="fsdp2")
    model = TrainableModel(name="m", project="p", base_model=str(tiny_model_dir), lora_rank=4)
    await model.register(backend)
    await backend.train(model, synthetic_groups(0), learning_rate=1e-2)
    # Rank 0's whole weights, gathered from the two FSDP2 shards.
    gathered = backend.client(model).executor.full_tensors("weights")[0]
    await backend.close()
    trained = apply_lora(load_hf_model(tiny_model_dir), LoraSettings(rank=4), seed=0)
    missing = set(gathered) - {n for n, _ in trained.named_parameters()}
    assert not missing, missing
    trained.load_state_dict(gathered, strict=False)
    export_model(model.directory, tmp_path / "out")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    # The checkpoint holds the same gathered tensors: only fp32 summation order differs.
    torch.testing.assert_close(_logits(plain), _logits(trained), rtol=0, atol=FP32_ATOL)
    assert (_logits(plain) - _logits(load_hf_model(tiny_model_dir))).abs().max() > 1e-3
