"""The weights of a Tinker checkpoint, fetched through the official tinker SDK for `export_model`.

As `tinker checkpoint download` does: a training checkpoint (`tinker://<run>/weights/<name>`) is
loaded into a new training client on the service, which saves it as external weights; their
files are downloaded from the URLs the service signs, and the temporary external weights are
deleted. An external weights path (`tinker://<run>/external_weights/<name>`) is downloaded as it
is. From `posttrain serve` the files are a posttrain checkpoint (adapter or full weights, with
its manifest), which `export_model` then merges or copies like a local one.
"""

from __future__ import annotations

import shutil
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from posttrain.backends.tinker_index import INDEX, parse, read_lines

TINKER_PREFIX = "tinker://"


@dataclass(frozen=True)
class FetchedCheckpoint:
    directory: Path  # the checkpoint's files
    base_model: str  # as the service names it


def is_tinker_model(model_dir: Path) -> bool:
    """Whether a model directory is a TinkerBackend model's (its checkpoints on the service)."""
    return (model_dir / INDEX).is_file() and not (model_dir / "checkpoints").is_dir()


def tinker_checkpoint(source: str | Path, step: int | None) -> tuple[str, int | None]:
    """(tinker:// path, step) of a tinker:// path, or of a TinkerBackend model directory's
    checkpoint of `step` (default: the latest recorded)."""
    if isinstance(source, str):
        if step is not None:
            raise ValueError(
                f"--step picks a checkpoint of a model directory; {source} names one already"
            )
        return source, None
    lines = read_lines(source)
    records = [r for r in map(parse, lines) if r is not None]
    if lines and parse(lines[-1]) is None:
        raise ValueError(
            f"the last line of {source / INDEX} is not a checkpoint record ({lines[-1][:80]!r}); "
            "export a recorded step with --step, or delete that line"
        )
    steps = sorted({r.step for r in records})
    if not steps:
        raise FileNotFoundError(f"{source / INDEX} records no checkpoint")
    chosen = steps[-1] if step is None else step
    found = [r for r in records if r.step == chosen]
    if not found:
        listed = ", ".join(map(str, steps))
        raise ValueError(
            f"step {step} has no checkpoint in {source / INDEX}; steps with a checkpoint: {listed}"
        )
    return found[-1].path, chosen


def fetch_tinker_checkpoint(
    tinker_path: str, directory: Path, *, base_url: str | None, api_key: str | None
) -> FetchedCheckpoint:
    """Download the weights of `tinker_path` into the new `directory`."""
    try:
        import tinker
    except ImportError as exc:
        raise ImportError(
            "exporting a tinker:// checkpoint needs the tinker SDK: pip install 'posttrain[tinker]'"
        ) from exc
    parsed = tinker.types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
    if parsed.checkpoint_type == "sampler":
        raise ValueError(
            f"{tinker_path} holds sampler weights, which the service cannot export; export the "
            "training checkpoint (tinker://<run>/weights/<name>) saved at the same step"
        )
    # The SDK's RestClient itself: ServiceClient.create_rest_client() is deprecated (SDK 0.38).
    rest = tinker.RestClient(base_url=base_url, api_key=api_key)
    service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    status: Literal["success", "errored"] = "errored"
    try:
        base_model = rest.get_weights_info_by_tinker_path(tinker_path).result().base_model
        external = tinker_path
        if parsed.checkpoint_type == "training":
            client = service.create_training_client_from_state(
                tinker_path, user_metadata={"created_by": "posttrain export"}
            ).result()
            name = f"posttrain-export-{uuid.uuid4().hex[:12]}"
            external = client.save_weights_external(name).result().path
        try:
            _download(rest.get_external_weights_urls(external).result().urls, directory)
        finally:
            if external != tinker_path:
                rest.delete_checkpoint_from_tinker_path(external).result()
        status = "success"
    finally:
        service.close(status).result()
    return FetchedCheckpoint(directory, base_model)


def _download(urls: dict[str, str], directory: Path) -> None:
    if not urls:
        raise ValueError("the service's external weights hold no files")
    directory.mkdir(parents=True)
    root = directory.resolve()
    for name, url in sorted(urls.items()):
        target = (directory / name).resolve()
        if not target.is_relative_to(root):
            raise ValueError(f"the service named a file outside the checkpoint: {name!r}")
        target.parent.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(url, timeout=60) as response, target.open("wb") as out:
            shutil.copyfileobj(response, out)
