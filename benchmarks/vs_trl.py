"""posttrain's LocalBackend against TRL's GRPOTrainer: GRPO steps on the same model and batch.

Both sides train the same model (`small`: a ~30M-parameter Qwen2; `qwen2.5-0.5b`:
Qwen2.5-0.5B's architecture, random weights; both built locally, nothing downloaded; or any
local model directory with `--model DIR`, e.g. one from `posttrain fetch-model`) on the same
device (`--device cpu` or `cuda`) at the same precision and with
the same fine-tuning: full fine-tuning in float32 by default, or LoRA (`--lora-rank`: the same
rank, alpha, target modules and float32 adapters on both sides, which `--dtype bfloat16`
requires). No gradient checkpointing. The prompts are reverse-task prompts: 8 prompts x 8 samples,
exactly 16 sampled tokens each (posttrain samples with `stop=[]`, TRL with `min_new_tokens`, so
neither stops early), temperature 1.0, then one AdamW step on the 64 completions with the same
learning rate, Adam betas/eps, grad clip 1.0, a PPO-clipped token-level loss (epsilon 0.2)
averaged over every completion token of the batch, group-std-scaled advantages, no KL, no
checkpoints, no logging. The reward is the same function on both sides (the share of the
completion's characters that are letters of the answer: it varies within a group, so every
group trains). TRL runs its own `trainer.train()` loop in a thread that a callback pauses
between steps, so the two sides alternate in rounds in one process (the order flips every round:
A B, B A, ...); each side's first step is a warm-up and is not measured.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/vs_trl.py \\
        [--steps 5] [--rounds 2] [--model-size small | --model DIR] [--dtype float32] \\
        [--lora-rank R] [--device cpu] [--no-trl] [--threads 2] [--json]

On a GPU each side also reports its own peak GPU memory and MFU (`gpu_metrics.py` defines
them); `--no-trl` times posttrain alone (where TRL is not installed, as on gpu-check's machine).

In bfloat16 both sides hold the base weights in bfloat16 (posttrain `dtype="bfloat16"`; TRL's
model loaded in bfloat16 with `bf16=True`), and PEFT keeps both sides' adapters in float32.

TRL is not a posttrain dependency: `pip install -r benchmarks/requirements-trl.txt`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import platform
import queue
import random
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

import torch
from gpu_metrics import PeakMemory, StepFlops, matmul_parameters, mfu, peak_flops, synchronize
from host import describe_host, host_line
from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
from transformers.utils import logging as hf_logging

import posttrain
from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.data.trajectories import TrajectoryGroup
from posttrain.models.load import LoraSettings
from posttrain.models.tiny import tiny_model_path
from posttrain.rollouts.builder import TrajectoryBuilder
from posttrain.tasks.protocol import Problem
from posttrain.tasks.reverse import ReverseTask
from posttrain.types import SampleResponse, SamplingParams

REQUIREMENTS = "benchmarks/requirements-trl.txt"


@dataclass(frozen=True)
class BenchConfig:
    """What both sides share."""

    model_size: str = "small"
    model_dir: str | None = None  # a local model directory instead of a built model_size
    device: str = "cpu"
    trl: bool = True  # False: posttrain alone
    park: str = "auto"  # posttrain's parking of training state while sampling: auto | always
    dtype: str = "float32"  # float32 | bfloat16, both sides
    lora_rank: int | None = None  # None: full fine-tuning
    prompts: int = 8
    group_size: int = 8
    new_tokens: int = 16
    learning_rate: float = 1e-5
    temperature: float = 1.0
    epsilon: float = 0.2
    adam_betas: tuple[float, float] = (0.9, 0.95)  # posttrain's (Tinker's) AdamW defaults
    adam_eps: float = 1e-12
    grad_clip: float = 1.0
    threads: int = 2
    warmup_steps: int = 1
    steps: int = 5  # measured steps per side per round
    rounds: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise SystemExit(f"--dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.dtype != "float32" and self.lora_rank is None:
            raise SystemExit(
                f"--dtype {self.dtype} needs --lora-rank: posttrain refuses full fine-tuning "
                "without float32 weights (updates below bf16's resolution would be lost)"
            )

    @property
    def lora(self) -> LoraSettings | None:
        """posttrain's LoRA for the rank (its default alpha), mirrored on TRL's side. Without the
        unembedding: TRL refuses LoRA on `lm_head` (it reads `lm_head.weight` directly)."""
        if self.lora_rank is None:
            return None
        alpha = LoraSettings.default_alpha(self.lora_rank)
        return LoraSettings(rank=self.lora_rank, alpha=alpha, train_unembed=False)

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.steps * self.rounds


@dataclass(frozen=True)
class StepTiming:
    """One optimizer step as the caller sees it; generation is the sampling call alone."""

    seconds: float
    generation_seconds: float
    completion_tokens: int
    prompt_tokens: int


def letter_share(answer: str, completion: str) -> float:
    """The share of the completion's characters that are letters of the answer (0 if empty)."""
    if not completion:
        return 0.0
    return sum(char in answer for char in completion) / len(completion)


def make_problems(config: BenchConfig) -> list[Problem]:
    """The prompts of every step in order (both sides see the same ones)."""
    rng = random.Random(config.seed)
    return ReverseTask().make_prompts(rng, config.prompts * config.total_steps)


def import_trl() -> ModuleType:
    try:
        import trl
    except ImportError as error:
        raise SystemExit(
            f"TRL is not installed ({error}); it is a benchmark-only dependency: "
            f"pip install -r {REQUIREMENTS}"
        ) from error
    return trl


class PosttrainSide:
    """The step a user writes: sample_many, TrajectoryBuilder, backend.train."""

    name = "posttrain"

    def __init__(self, model_path: Path, config: BenchConfig, workdir: Path) -> None:
        self.config = config
        self.runner = asyncio.Runner()
        self.backend = LocalBackend(workdir / "posttrain", device=config.device)
        # Without the unembedding, as TRL; a LoRA switch, so only given with LoRA.
        layers = {} if config.lora is None else {"train_unembed": False}
        self.model = TrainableModel(
            name="vs-trl",
            project="bench",
            base_model=str(model_path),
            lora_rank=config.lora_rank,  # None: full fine-tuning
            dtype=config.dtype,  # pyright: ignore[reportArgumentType]
            seed=config.seed,
            **layers,  # pyright: ignore[reportArgumentType]
        )
        self.runner.run(self.model.register(self.backend))
        if config.park == "always":  # what "auto" does for a model too big for its GPU
            self.backend.client(self.model).dispatch.park_for_sampling = True

    def torch_model(self) -> torch.nn.Module:
        executor = self.backend.client(self.model).dispatch.executor
        return executor.workers[0].model  # pyright: ignore[reportAttributeAccessIssue]

    def matmul_parameters(self) -> int:
        return matmul_parameters(self.torch_model())

    def trainable_parameters(self) -> tuple[int, int]:
        params = list(self.torch_model().parameters())
        return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)

    def step(self, problems: Sequence[Problem]) -> StepTiming:
        return self.runner.run(self._step(problems))

    async def _step(self, problems: Sequence[Problem]) -> StepTiming:
        config = self.config
        start = time.perf_counter()
        sampler = self.backend.sampling_client(self.model)
        builders = [TrajectoryBuilder(sampler.tokenizer) for _ in problems]
        prompts = [
            b.prompt({"role": "user", "content": p.prompt})
            for b, p in zip(builders, problems, strict=True)
        ]
        params = SamplingParams(
            max_tokens=config.new_tokens, temperature=config.temperature, stop=[]
        )
        sample_start = time.perf_counter()
        responses = await sampler.sample_many(prompts, config.group_size, params)
        generation = time.perf_counter() - sample_start
        groups = [build_group(*args) for args in zip(builders, problems, responses, strict=True)]
        synchronize(config.device)
        await self.backend.train(
            self.model,
            groups,
            learning_rate=config.learning_rate,
            loss="ppo",
            epsilon=config.epsilon,
            loss_reduction="token_mean",
            advantage_estimator="grpo",
            scale_rewards=True,
            zero_variance_groups="keep",  # TRL trains on every group
            grad_clip=config.grad_clip,
            save_checkpoint=False,  # TRL does not checkpoint either
        )
        synchronize(config.device)
        return StepTiming(
            seconds=time.perf_counter() - start,
            generation_seconds=generation,
            completion_tokens=sum(len(s.tokens) for r in responses for s in r.sequences),
            prompt_tokens=sum(len(p) for p in prompts) * config.group_size,
        )

    def close(self) -> None:
        self.runner.run(self.backend.close())
        self.runner.close()


def build_group(
    builder: TrajectoryBuilder, problem: Problem, response: SampleResponse
) -> TrajectoryGroup:
    trajectories = []
    for sequence in response.sequences:
        turn = builder.fork()
        text = turn.completion(sequence)
        trajectories.append(turn.build(reward=letter_share(problem.answer or "", text)))
    return TrajectoryGroup(tuple(trajectories))


class StepGate(TrainerCallback):
    """Holds TRL's training loop at the start of each step until the benchmark lets it go.

    `arrivals` gets the time the loop reached the gate (or finished, or the exception it died
    of), so a step is measured from its release to the next arrival: generation, loss, backward,
    optimizer, and TRL's per-step bookkeeping between steps.
    """

    def __init__(self) -> None:
        self.release = threading.Semaphore(0)
        self.arrivals: queue.Queue[float | BaseException] = queue.Queue()

    def on_step_begin(self, args, state, control, **kwargs):
        # Returning None leaves TRL's `control` as it is.
        self.arrivals.put(time.perf_counter())
        self.release.acquire()


class TrlSide:
    """TRL's GRPOTrainer.train() on the same batches, one step per call of `step`."""

    name = "trl"

    def __init__(
        self, model_path: Path, config: BenchConfig, problems: list[Problem], workdir: Path
    ):
        self.trl = import_trl()
        self.config = config
        self.gate = StepGate()
        self.generations: list[StepTiming] = []
        self.trainer = self._make_trainer(model_path, problems, workdir)
        self._time_generation()
        self.thread = threading.Thread(target=self._train, name="trl-train", daemon=True)
        self.thread.start()
        self._wait_for_gate()

    def _make_trainer(self, model_path: Path, problems: list[Problem], workdir: Path):
        from datasets import Dataset

        dataset = Dataset.from_dict(
            {
                "prompt": [[{"role": "user", "content": p.prompt}] for p in problems],
                "answer": [p.answer for p in problems],
            }
        )
        dtype = getattr(torch, self.config.dtype)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        give_lm_head_contiguous_inputs(model)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        trainer = self.trl.GRPOTrainer(
            model=model,
            peft_config=self._peft_config(),
            reward_funcs=trl_reward,
            args=self._grpo_config(workdir),
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[self.gate],
        )
        trainer.remove_callback(PrinterCallback)  # it prints the run's summary metrics at the end
        return trainer

    def _peft_config(self):
        """posttrain's LoRA as a PEFT config: same rank, alpha, dropout and target modules
        (PEFT upcasts the adapters to float32 on a bf16 base, as posttrain's do)."""
        lora = self.config.lora
        if lora is None:
            return None
        from peft import LoraConfig

        return LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,  # pyright: ignore[reportArgumentType]
            lora_dropout=lora.dropout,
            target_modules=lora.target_modules(),
            bias="none",
            task_type="CAUSAL_LM",
        )

    def _grpo_config(self, workdir: Path):
        config = self.config
        completions = config.prompts * config.group_size
        return self.trl.GRPOConfig(
            output_dir=str(workdir / "trl"),
            # One generation batch of 64 completions = one micro-batch = one optimizer step.
            per_device_train_batch_size=completions,
            gradient_accumulation_steps=1,
            steps_per_generation=1,
            num_iterations=1,
            num_generations=config.group_size,
            max_steps=config.total_steps,
            max_completion_length=config.new_tokens,
            generation_kwargs={"min_new_tokens": config.new_tokens},
            temperature=config.temperature,
            beta=0.0,
            loss_type="dapo",  # token mean over the whole batch = posttrain's token_mean
            epsilon=config.epsilon,
            scale_rewards="group",
            learning_rate=config.learning_rate,
            lr_scheduler_type="constant",
            adam_beta1=config.adam_betas[0],
            adam_beta2=config.adam_betas[1],
            adam_epsilon=config.adam_eps,
            weight_decay=0.0,
            max_grad_norm=config.grad_clip,
            bf16=config.dtype == "bfloat16",
            fp16=False,
            gradient_checkpointing=False,
            use_cpu=config.device == "cpu",
            use_vllm=False,
            shuffle_dataset=False,
            seed=config.seed,
            report_to="none",
            logging_strategy="no",
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )

    def _time_generation(self) -> None:
        """Wrap the trainer's sampling call to time it and count its tokens (measurement only)."""
        original: Callable = self.trainer._generate_single_turn

        def timed(prompt_ids, *args, **kwargs):
            synchronize(self.config.device)
            start = time.perf_counter()
            completion_ids, logprobs = original(prompt_ids, *args, **kwargs)
            synchronize(self.config.device)
            self.generations.append(
                StepTiming(
                    seconds=0.0,
                    generation_seconds=time.perf_counter() - start,
                    completion_tokens=sum(len(ids) for ids in completion_ids),
                    prompt_tokens=sum(len(ids) for ids in prompt_ids),
                )
            )
            return completion_ids, logprobs

        self.trainer._generate_single_turn = timed

    def _train(self) -> None:
        torch.set_num_threads(self.config.threads)
        try:
            self.trainer.train()
        except BaseException as error:  # handed to the waiting benchmark thread
            self.gate.arrivals.put(error)
            return
        self.gate.arrivals.put(time.perf_counter())

    def _wait_for_gate(self) -> float:
        arrival = self.gate.arrivals.get()
        if isinstance(arrival, BaseException):
            raise RuntimeError("TRL's training loop failed") from arrival
        return arrival

    def step(self, problems: Sequence[Problem]) -> StepTiming:
        """Run TRL's next step (its dataset yields the same `problems` in the same order)."""
        self.generations.clear()
        start = time.perf_counter()
        self.gate.release.release()
        end = self._wait_for_gate()  # TRL's loop has synchronized (its loss reads .item())
        (generation,) = self.generations
        return StepTiming(
            seconds=end - start,
            generation_seconds=generation.generation_seconds,
            completion_tokens=generation.completion_tokens,
            prompt_tokens=generation.prompt_tokens,
        )

    def matmul_parameters(self) -> int:
        return matmul_parameters(self.trainer.model)

    def trainable_parameters(self) -> tuple[int, int]:
        params = list(self.trainer.model.parameters())
        return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)

    def close(self) -> None:
        self.thread.join()


def give_lm_head_contiguous_inputs(model: torch.nn.Module) -> None:
    """posttrain's sampler fix, given to TRL's model too (a forward pre-hook on lm_head).

    `generate` asks for the last position's logits with `logits_to_keep=1`, a non-contiguous
    [rows, 1, hidden] slice, which torch's linear runs as a bmm on lm_head's weight expanded
    once per row. At 0.5B in bf16 that is 64 x 896 x 151936 x 2 bytes = 17 GB per prefill: the
    benchmark was OOM-killed on a 24 GiB machine without this hook.
    """
    head = getattr(model, "get_output_embeddings")()  # noqa: B009 - HF's method, hidden by nn.Module's stubs
    head.register_forward_pre_hook(lambda _module, args: (args[0].contiguous(), *args[1:]))


def trl_reward(completions: list, answer: list[str], **kwargs: object) -> list[float]:
    """`letter_share` in TRL's reward-function signature (conversational completions)."""
    return [letter_share(a, c[0]["content"]) for c, a in zip(completions, answer, strict=True)]


Side = PosttrainSide | TrlSide


def batches_of(problems: list[Problem], config: BenchConfig) -> list[list[Problem]]:
    return [problems[i : i + config.prompts] for i in range(0, len(problems), config.prompts)]


def build_sides(
    model_path: Path, config: BenchConfig, problems: list[Problem], workdir: Path, meter: PeakMemory
) -> list[Side]:
    """Each side built and warmed up (its first steps, not measured) before the next is built,
    so the meter sees what each holds resident after an optimizer step."""
    batches = batches_of(problems, config)
    sides: list[Side] = []
    makers: list[Callable[[], Side]] = [lambda: PosttrainSide(model_path, config, workdir)]
    if config.trl:
        makers.append(lambda: TrlSide(model_path, config, problems, workdir))
    for make in makers:
        meter.start_building()
        side = make()
        for batch in batches[: config.warmup_steps]:
            side.step(batch)
        meter.built(side.name)
        sides.append(side)
    return sides


def run_rounds(
    sides: Sequence[Side], problems: list[Problem], config: BenchConfig, meter: PeakMemory
) -> dict[str, list[StepTiming]]:
    """Rounds of measured steps after the warm-ups, the order flipping every round."""
    batches = batches_of(problems, config)
    cursor = {side.name: config.warmup_steps for side in sides}
    timings: dict[str, list[StepTiming]] = {side.name: [] for side in sides}

    def run(side: Side, count: int) -> list[StepTiming]:
        out = []
        for _ in range(count):
            meter.start_step()
            out.append(side.step(batches[cursor[side.name]]))
            meter.end_step(side.name)
            cursor[side.name] += 1
        return out

    for round_index in range(config.rounds):
        order = sides if round_index % 2 == 0 else list(reversed(sides))
        for side in order:
            timings[side.name].extend(run(side, config.steps))
    return timings


def summarize(
    steps: list[StepTiming], config: BenchConfig, n: int, peak: float | None
) -> dict[str, float | None]:
    seconds = [s.seconds for s in steps]
    step = steps[seconds.index(statistics.median_low(seconds))]  # the median step itself
    unique = step.prompt_tokens // config.group_size + step.completion_tokens
    flops = StepFlops.of(n, unique, full_fine_tuning=config.lora is None)
    return {
        "median_step_s": statistics.median(seconds),
        "min_step_s": min(seconds),
        "max_step_s": max(seconds),
        "steps_per_s": 1 / statistics.median(seconds),
        "completion_tokens_per_s": statistics.median(
            s.completion_tokens / s.seconds for s in steps
        ),
        "completion_tokens_per_step": statistics.mean(s.completion_tokens for s in steps),
        "prompt_tokens_per_step": statistics.mean(s.prompt_tokens for s in steps),
        "generation_fraction": statistics.median(s.generation_seconds / s.seconds for s in steps),
        "median_generation_s": statistics.median(s.generation_seconds for s in steps),
        "matmul_parameters": n,
        "mfu_step": mfu(flops.sampling + flops.training, step.seconds, peak),
        "mfu_training": mfu(flops.training, step.seconds - step.generation_seconds, peak),
    }


def installed_version(name: str) -> str:
    """The installed distribution's version; posttrain run from a source tree (PYTHONPATH=src,
    as scripts/gpu-check does) has no metadata, so it reports the package's own version."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        if name == "posttrain":
            return f"{posttrain.__version__} (source tree)"
        return "not installed"


def versions(config: BenchConfig) -> dict[str, str]:
    names = ["posttrain", "torch", "transformers", "peft"]
    names += ["trl", "accelerate", "datasets"] if config.trl else []
    found = {name: installed_version(name) for name in names}
    found["host"] = describe_host(config.device)  # the ratio moves with the CPU's ISA
    if torch.device(config.device).type == "cuda":
        found["gpu"] = torch.cuda.get_device_name()
        found["cuda"] = str(torch.version.cuda)
    return {"python": platform.python_version(), **found}


def describe(config: BenchConfig, params: tuple[int, int]) -> dict[str, object]:
    return {
        **asdict(config),
        "model": config.model_dir
        or f"qwen2 {config.model_size} (posttrain.models.tiny), built locally",
        "parameters": params[0],
        "trainable_parameters": params[1],
        "completions_per_step": config.prompts * config.group_size,
        "dtype": config.dtype,
        "gradient_checkpointing": False,
        "fine_tuning": "full (posttrain lora_rank=None)"
        if config.lora is None
        else f"LoRA rank {config.lora.rank}, alpha {config.lora.alpha:g}, "
        f"modules {','.join(config.lora.target_modules())}, float32 adapters",
        "loss": "ppo clip, token mean over the batch (posttrain loss='ppo', "
        "loss_reduction='token_mean'; TRL loss_type='dapo')",
        "advantages": "(r - mean) / std per group (posttrain grpo, scale_rewards=True; "
        "TRL scale_rewards='group'); posttrain zero_variance_groups='keep'",
        "kl": "none (posttrain kl_penalty_coef=0; TRL beta=0)",
        "checkpoints": "off (posttrain save_checkpoint=False; TRL save_strategy='no')",
        "logging": "off (posttrain: no model.log; TRL report_to='none', logging_strategy='no')",
        "early_stop": "none (posttrain stop=[]; TRL min_new_tokens=new_tokens)",
        "torch_threads": torch.get_num_threads(),
        "device": config.device,
    }


def print_report(report: dict[str, dict]) -> None:
    print("configuration")
    for key, value in {**report["config"], **report["versions"]}.items():
        print(f"  {key:28s} {value}")
    names = list(report["sides"])
    rows = [
        ("median step (s)", "median_step_s", ".3f"),
        ("min / max step (s)", None, ""),
        ("steps/s", "steps_per_s", ".3f"),
        ("completion tokens/s", "completion_tokens_per_s", ".0f"),
        ("completion tokens/step", "completion_tokens_per_step", ".1f"),
        ("prompt tokens/step", "prompt_tokens_per_step", ".1f"),
        ("generation share of step", "generation_fraction", ".2f"),
        ("peak GPU memory (GiB)", "peak_gpu_gib", ".2f"),
        ("MFU, whole step", "mfu_step", ".1%"),
        ("MFU, training phase", "mfu_training", ".1%"),
    ]
    print("\n" + " " * 28 + "".join(f" {name:>12s}" for name in names))
    for label, key, fmt in rows:
        if key is None:
            cells = [
                f"{s['min_step_s']:.3f}/{s['max_step_s']:.3f}" for s in report["sides"].values()
            ]
        else:
            values = [s.get(key) for s in report["sides"].values()]
            if all(v is None for v in values):
                continue  # a GPU figure on the CPU, or an unknown chip's peak
            cells = ["-" if v is None else format(v, fmt) for v in values]
        print(f"  {label:26s}" + "".join(f" {cell:>12s}" for cell in cells))
    if report["ratios"]:
        print("\nratios (posttrain / trl)")
    for key, value in report["ratios"].items():
        print(f"  {key:28s} {value:.2f}x")


def model_directory(config: BenchConfig) -> Path:
    if config.model_dir is None:
        return tiny_model_path(size=config.model_size)  # pyright: ignore[reportArgumentType]
    path = Path(config.model_dir).expanduser()
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {config.model_dir}: no config.json there (a model directory)")
    return path


def ratios(sides: dict[str, dict[str, float | None]]) -> dict[str, float]:
    if "trl" not in sides:
        return {}
    ours, theirs = sides["posttrain"], sides["trl"]
    return {
        key: float(ours[key]) / float(theirs[key])  # pyright: ignore[reportArgumentType]
        for key in ("steps_per_s", "completion_tokens_per_s")
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=5, help="measured steps per side per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--model-size", default="small", choices=["tiny", "mini", "small", "qwen2.5-0.5b"]
    )
    parser.add_argument("--model", metavar="DIR", help="a local model directory (any size)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (both sides)")
    parser.add_argument("--no-trl", action="store_true", help="time posttrain alone")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=16, help="sampled tokens each")
    parser.add_argument(
        "--park",
        default="auto",
        choices=["auto", "always"],
        help="posttrain: park gradients and AdamW moments off the GPU while sampling "
        "(auto: only when they would fill over a quarter of it)",
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--lora-rank", type=int, default=None, help="LoRA on both sides (default: full)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads (both sides)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, dict]:
    args = parse_args(argv)
    if not args.json:  # --json prints one JSON object, which holds the host
        print(host_line(args.device), flush=True)
    config = BenchConfig(
        model_size=args.model_size,
        model_dir=args.model,
        device=args.device,
        trl=not args.no_trl,
        park=args.park,
        prompts=args.prompts,
        group_size=args.group_size,
        new_tokens=args.new_tokens,
        dtype=args.dtype,
        lora_rank=args.lora_rank,
        steps=args.steps,
        rounds=args.rounds,
        threads=args.threads,
    )
    if config.trl:
        import_trl()  # fail before building anything
    hf_logging.set_verbosity_error()
    # transformers' deprecation notices for arguments TRL passes on (gradient_checkpointing).
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    model_path = model_directory(config)
    problems = make_problems(config)
    meter = PeakMemory(config.device)
    peak = peak_flops(versions(config).get("gpu", ""), config.dtype)
    with tempfile.TemporaryDirectory(prefix="posttrain-vs-trl-") as tmp:
        sides_built = build_sides(model_path, config, problems, Path(tmp), meter)
        try:
            timings = run_rounds(sides_built, problems, config, meter)
            counts = {side.name: side.matmul_parameters() for side in sides_built}
            params = sides_built[-1].trainable_parameters()
        finally:
            for side in sides_built:
                side.close()
    sides = {name: summarize(steps, config, counts[name], peak) for name, steps in timings.items()}
    for name, bytes_ in meter.peaks.items():
        sides[name]["peak_gpu_gib"] = bytes_ / 2**30
    report = {
        "config": describe(config, params),
        "versions": versions(config),
        "sides": sides,
        "ratios": ratios(sides),
        "steps": {name: [asdict(s) for s in steps] for name, steps in timings.items()},
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return report


if __name__ == "__main__":
    main()
