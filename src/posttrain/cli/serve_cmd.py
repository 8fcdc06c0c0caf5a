"""`posttrain serve`: the Tinker-compatible and OpenAI-compatible server (extra `server`)."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `serve` on the `posttrain` command."""
    parser = subparsers.add_parser(
        "serve",
        help="serve a base model over the Tinker protocol and OpenAI-compatible sampling",
        description=(
            "Serve BASE_MODEL for LoRA training over the Tinker HTTP protocol (the official "
            "tinker SDK works against it) and for sampling over /v1 (OpenAI-compatible). "
            "State lives in SQLite (--db) and checkpoints under --storage, so a restart keeps "
            "finished results and checkpoints."
        ),
    )
    parser.add_argument(
        "--base-model",
        required=True,
        help="a local directory, a hub id, a .gguf file (converted once into the cache), "
        "packaged:<name> (see `posttrain fetch-model --list`), or tiny:<arch>:<size>[:<seed>] "
        "(built locally)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--storage", type=Path, default=Path("posttrain-server"))
    parser.add_argument("--db", type=Path, default=None, help="default: STORAGE/state.db")
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="accepted key (repeatable; must start with tml-). Without one only loopback hosts "
        "are allowed, and any tml- key is accepted (each key still sees only its own state)",
    )
    parser.add_argument("--max-body-mb", type=float, default=64.0)
    parser.add_argument("--lora-rank-max", type=int, default=256)
    parser.add_argument(
        "--seq-gap-timeout",
        type=float,
        default=30.0,
        help="seconds a model waits for a missing seq_id before failing the requests behind it",
    )
    parser.add_argument(
        "--session-timeout",
        type=float,
        default=300.0,
        help="seconds without a heartbeat after which a session finishes and its models unload",
    )
    parser.add_argument(
        "--sampler-cache-size",
        type=int,
        default=16,
        help="sampling models (base model or checkpoints) kept loaded, least recently used first "
        "out; each holds an adapter, the base model's weights are shared",
    )
    parser.add_argument(
        "--max-resident-adapters",
        type=int,
        default=None,
        metavar="N",
        help="LoRA adapters (training clients with their optimizer state, and sampling "
        "models) kept in memory at most; an idle one beyond N is written to disk and reloaded "
        "on its next request; a Tinker API request waits up to 60 s for room while all N are "
        "busy. Default: no limit",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--packing",
        action="store_true",
        help="pack every training model's datums into rows, each attending only to itself "
        "(the results of the unpacked pass, less padding computed)",
    )
    parser.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from posttrain.server.config import ServerConfig, model_config_int

    storage = args.storage.resolve()
    try:
        # Checked before the heavy imports, so a refused host or key fails at once.
        config = ServerConfig(
            base_model=args.base_model,
            model_path="",  # resolved below
            db_path=(args.db or storage / "state.db").resolve(),
            storage_dir=storage,
            api_keys=tuple(args.api_key),
            host=args.host,
            port=args.port,
            max_body_bytes=int(args.max_body_mb * 1024 * 1024),
            lora_rank_max=args.lora_rank_max,
            seq_gap_timeout=args.seq_gap_timeout,
            session_timeout=args.session_timeout,
            sampler_cache_size=args.sampler_cache_size,
            max_resident_adapters=args.max_resident_adapters,
            device=args.device,
            packing=args.packing,
        )
    except ValueError as err:
        print(f"posttrain serve: {err}", file=sys.stderr)
        return 2
    try:
        import uvicorn  # noqa: F401 - checked here, used in _serve

        from posttrain.server.app import create_app
    except ImportError as err:
        print(f"posttrain serve needs the server extra: pip install 'posttrain[server]' ({err})")
        return 2
    from posttrain.cli.thread_report import thread_report
    from posttrain.engine.threads import configure_torch_threads
    from posttrain.jobs.run_dir import resolve_base_model
    from posttrain.models.source import resolve_model_source

    try:
        storage.mkdir(parents=True, exist_ok=True)
        # A directory the server loads from: a .gguf or packaged model converted now, once.
        model_path = resolve_model_source(resolve_base_model(args.base_model, storage))
    except (ValueError, FileNotFoundError) as err:
        print(f"posttrain serve: {err}", file=sys.stderr)
        return 2
    hidden_size = model_config_int(model_path, "hidden_size")
    try:
        # Before the server loads the model: it computes on one thread with this many OpenMP
        # threads (see posttrain.server.runtime), one for a tiny model.
        configure_torch_threads(hidden_size)
    except ValueError as err:
        print(f"posttrain serve: {err}", file=sys.stderr)
        return 2
    config = replace(config, model_path=model_path, aliases=(model_path,))
    # Server-side details of failed requests (error ids of 500s) go to stderr.
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    report = thread_report(hidden_size)
    log = logging.getLogger("posttrain.serve")
    log.info("threads: %s", report.describe())
    for warning in report.warnings():
        log.warning("threads: %s", warning)
    _serve(create_app(config), args.host, args.port)
    return 0


def _serve(app: object, host: str, port: int) -> None:
    """Run uvicorn, printing the URL once the socket accepts connections."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: list | None = None) -> None:
            await super().startup(sockets)
            if not self.should_exit:
                shown = f"[{host}]" if ":" in host else host
                print(f"posttrain serve: ready on http://{shown}:{port}", flush=True)

    Server(uvicorn.Config(app, host=host, port=port, log_level="warning")).run()  # pyright: ignore[reportArgumentType]
