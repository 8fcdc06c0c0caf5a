"""The parity check's evidence: the mean |sampler − trainer logprob| the check judged
(`parity_logprob_diff_mean`) of each RL step, for a correct engine and a faulty one, so that
the bounds in `trainer/parity.py` sit between the two with a stated margin.

The demo's model (`tiny:qwen2:mini`, 0.5M parameters) and its RL sampling (temperature 1,
10 tokens, groups of 8), `--prompts` prompts a step, rewards drawn at random (seeded) so that
every group trains; LoRA `--lora-rank` (bf16 needs LoRA: full fine-tuning in bf16 is refused),
learning rate `--lr`. `--fault previous` wraps the engine so that it serves the previous
sync's weights while it claims the new version; the check is then "warn", so the run goes on
and every step's gap is recorded. A correct run keeps the default "error": a false alarm ends
it.

    OMP_NUM_THREADS=1 python benchmarks/parity_gap.py [--dtype bfloat16] [--devices cpu,cpu]
        [--fault previous] [--steps 50] [--prompts 8] [--lr 1e-3]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
from pathlib import Path

from host import host_line

import posttrain
from posttrain.data.trajectories import POLICY_VERSION, TrajectoryGroup
from posttrain.inference.faults import FaultyEngine
from posttrain.models.tiny import tiny_model_path
from posttrain.trainer.parity import PARITY_METRIC
from posttrain.types import SamplingParams

WORDS = ["abc", "hello", "world", "xyz", "reverse", "engine", "tokens", "reward"]


async def gaps(args: argparse.Namespace, root: Path) -> list[float]:
    inference: dict[str, object] = {"parity_check": "warn" if args.fault != "none" else "error"}
    if args.devices:
        inference.update(devices=args.devices, threads=1, dtype=args.dtype)
    backend = posttrain.LocalBackend(root, inference=inference)
    model = posttrain.TrainableModel(
        name="m",
        project="parity",
        base_model=str(tiny_model_path(size="mini")),
        lora_rank=args.lora_rank,
        dtype=args.dtype,
        seed=0,
    )
    await model.register(backend)
    if args.fault == "previous":
        session = backend._models.record(model).engine  # the engine it samples with: swapped
        session.engine = FaultyEngine(session.engine, "previous")
    rewards = random.Random(0)
    found: list[float] = []
    try:
        sampler = backend.sampling_client(model)
        for step in range(args.steps):
            words = [WORDS[(step + i) % len(WORDS)] for i in range(args.prompts)]
            builders = [posttrain.TrajectoryBuilder(sampler.tokenizer) for _ in words]
            prompts = [
                b.prompt({"role": "user", "content": w})
                for b, w in zip(builders, words, strict=True)
            ]
            params = SamplingParams(max_tokens=10, seed=step, temperature=1.0)
            responses = await sampler.sample_many(prompts, 8, params)
            groups = []
            for builder, response in zip(builders, responses, strict=True):
                group = []
                for sequence in response.sequences:
                    turn = builder.fork()
                    turn.completion(sequence)
                    stamp = {POLICY_VERSION: response.policy_version}
                    group.append(turn.build(reward=rewards.random(), metadata=stamp))
                groups.append(TrajectoryGroup(tuple(group)))
            result = await backend.train(
                model, groups, learning_rate=args.lr, loss="ppo", save_checkpoint=False
            )
            # Here every token is on-policy and one mini-batch trains: logprob_diff_mean equal.
            found.append(result.metrics[PARITY_METRIC])
    finally:
        await backend.close()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--devices", default=None, help="cpu,cpu: the split pytorch engine")
    parser.add_argument("--fault", choices=["none", "previous"], default="none")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    print(host_line(), flush=True)
    with tempfile.TemporaryDirectory() as root:
        found = asyncio.run(gaps(args, Path(root)))
    label = f"{args.dtype} devices={args.devices or 'live'} lr={args.lr:g} fault={args.fault}"
    later = found[1:] or found
    print(
        f"{label}: {len(found)} steps, {PARITY_METRIC} max {max(found):.3g} median "
        f"{statistics.median(found):.3g}; from step 2 on min {min(later):.3g}; "
        f"first 3 {[float(f'{g:.3g}') for g in found[:3]]}"
    )


if __name__ == "__main__":
    main()
