"""The openai engine's weight sync against a real vLLM server: `sync = "lora"` (the adapter
alone, `/v1/load_lora_adapter`) beside `sync = "reload"` (whole LoRA-merged weights,
`/collective_rpc reload_weights`), on one server and one LoRA client, alternating.

Each round syncs the client's current weights once through each route, as the step after an
optimizer step does: gather the trainable tensors, write them to /dev/shm, the server loads
them. Prints each route's median seconds (of which write and load) and bytes written, and the
ratio. The server needs the vLLM venv (scripts/setup-vllm.sh); it starts with both
VLLM_SERVER_DEV_MODE=1 and runtime LoRA. Timings on a shared machine: read `uptime` with them.

    python benchmarks/openai_sync.py [--size mini] [--rank 8] [--rounds 5] [--vllm-python PY]
    python benchmarks/openai_sync.py --url http://HOST:PORT/v1 --model DIR  # a running server

A running server must serve DIR as "base" with the flags above; it is left serving adapters'
weights (the last reload): the tests' shared server is restored after the run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path

from posttrain.clients.create import create_training_client
from posttrain.inference.config import InferenceConfig
from posttrain.inference.openai_engine import VLLM_LORA_RANKS
from posttrain.inference.session import EngineSession
from posttrain.models.lora import LoraSettings
from posttrain.models.tiny import tiny_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from host import host_line
from tests.inference.vllm_server import vllm_server


async def run(args: argparse.Namespace, url: str, model: Path, work: Path) -> None:
    client = create_training_client(
        model, lora_rank=args.rank, train_unembed=False, storage_dir=work / "client"
    )
    sessions: dict[str, EngineSession] = {}
    for sync in ("lora", "reload"):
        config = InferenceConfig(engine="openai", url=url, model="base", sync=sync)
        sessions[sync] = await EngineSession.open(
            config,
            client,
            base_model=str(model),
            lora=LoraSettings.of(args.rank, train_unembed=False),
            version=0,
            log_dir=work,
        )
    rows: dict[str, list[tuple[float, float, float, float]]] = {s: [] for s in sessions}
    for version in range(1, args.rounds + 1):
        for sync, session in sessions.items():
            await session.sync(version)
            last = session.last_sync
            rows[sync].append(
                (
                    last["sync_s"],
                    last["sync_write_s"],
                    last["sync_load_s"],
                    last["sync_bytes"],
                )
            )
    print(f"model {args.model or args.size}, LoRA rank {args.rank}, {args.rounds} rounds, medians:")
    print("route    sync_s  write_s  load_s   bytes")
    medians = {}
    for sync, values in rows.items():
        med = [statistics.median(column) for column in zip(*values, strict=True)]
        medians[sync] = med
        print(f"{sync:<7} {med[0]:7.4f} {med[1]:8.4f} {med[2]:7.4f} {med[3]:9.0f}")
    lora, reload = medians["lora"], medians["reload"]
    print(f"lora / reload: {lora[0] / reload[0]:.2f}x seconds, {lora[3] / reload[3]:.3f}x bytes")
    for session in sessions.values():
        await session.close()
    client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="openai engine: lora vs reload sync")
    parser.add_argument("--size", default="mini", choices=["mini", "small"])
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--vllm-python", help="an interpreter with vLLM (else as the tests find one)"
    )
    parser.add_argument("--url", help="a running vLLM server's .../v1 URL (else one is started)")
    parser.add_argument("--model", type=Path, help="the model directory it serves as 'base'")
    args = parser.parse_args()
    if (args.url is None) != (args.model is None):
        parser.error("--url and --model go together: the server's URL and the model it serves")
    print(host_line(), flush=True)
    if args.vllm_python:
        os.environ["POSTTRAIN_VLLM_PYTHON"] = args.vllm_python
    if args.url is not None:
        with tempfile.TemporaryDirectory() as tmp:
            asyncio.run(run(args, args.url, args.model, Path(tmp)))
        return
    model = tiny_model_path(size=args.size)
    max_rank = next(r for r in VLLM_LORA_RANKS if r >= args.rank)
    flags = ["--enable-lora", "--max-lora-rank", str(max_rank), "--max-loras", "3"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
        with vllm_server(model, work / "vllm-server.log", args=flags, env=env) as url:
            asyncio.run(run(args, url, model, work))


if __name__ == "__main__":
    main()
