"""Where a base model comes from: a local directory, a hub id, a `.gguf` file, or a packaged
model (`packaged:NAME`, see `models.packaged`). `resolve_model_source` is the one place a
spec becomes something transformers loads; `check_base_model` checks a spec before anything loads.

A path that does not exist is an error naming it. A hub id is fine when the Hugging Face cache
holds it, or when the hub answers a short HEAD for its config. Without either (no network, or
`HF_HUB_OFFLINE=1`) it is an error naming `HF_HUB_OFFLINE` and how to get the model locally,
instead of transformers' minute of retries ending in a traceback. Nothing is downloaded here.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

from posttrain.models.cache import HubUnreachableError

# What the Hub accepts as a repository id: "name" or "org/name".
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
HUB_TIMEOUT_S = 5.0
_TRUE = {"1", "on", "yes", "true"}
MODEL_HINT = (
    "give an existing model directory (one with config.json, e.g. built by "
    "`posttrain make-tiny-model DIR`), a .gguf file, a packaged model such as "
    "'packaged:smollm2-135m-instruct', or a Hugging Face hub id such as 'Qwen/Qwen3-0.6B'"
)
GGUF_SUFFIX = ".gguf"
PACKAGED_PREFIX = "packaged:"


def is_gguf(spec: str | Path) -> bool:
    """Whether `spec` names a GGUF file (by its suffix: a hub id never ends in .gguf)."""
    return str(spec).lower().endswith(GGUF_SUFFIX)


def resolve_model_source(spec: str | Path) -> str:
    """What transformers loads for the base model `spec`: a model directory or a hub id.

    `packaged:NAME` is fetched and imported, a `.gguf` file converted, each once and then read
    from the cache (`models.gguf`); a directory must hold config.json; a hub id is passed
    on for transformers to fetch (`check_base_model` checks it up front).
    """
    text = str(spec)
    if text.startswith(PACKAGED_PREFIX):
        from posttrain.models.packaged import fetch_model

        return str(fetch_model(text.removeprefix(PACKAGED_PREFIX)))
    if is_gguf(text):
        from posttrain.models.gguf import import_gguf

        return str(import_gguf(text))
    path = Path(text).expanduser()
    if path.exists():
        _check_model_dir(text, path)
        return str(path)
    if isinstance(spec, Path) or is_path_like(text):
        raise FileNotFoundError(f"base_model path {text!r} does not exist; {MODEL_HINT}")
    return text  # a hub id such as "Qwen/Qwen3-0.6B"


def cached_model_source(spec: str | Path) -> str | None:
    """What `resolve_model_source` would return, if that needs no download or conversion; else
    None. A directory or hub id is returned as it is."""
    text = str(spec)
    if text.startswith(PACKAGED_PREFIX):
        from posttrain.models.packaged import cached_packaged_model

        found = cached_packaged_model(text.removeprefix(PACKAGED_PREFIX))
    elif is_gguf(text):
        from posttrain.models.gguf import cached_gguf

        found = cached_gguf(text)
    else:
        return text
    return None if found is None else str(found)


def cache_note(spec: str) -> str | None:
    """Whether a `.gguf` or packaged base model is converted yet, in words; None for others."""
    if not (spec.startswith(PACKAGED_PREFIX) or is_gguf(spec)):
        return None
    found = cached_model_source(spec)
    if found is not None:
        return f"cached at {found}"
    if spec.startswith(PACKAGED_PREFIX):
        name = spec.removeprefix(PACKAGED_PREFIX)
        return (
            "not fetched yet: downloaded with pip and imported on first use, or now with "
            f"`posttrain fetch-model {name}`"
        )
    return (
        "not converted yet: converted into the cache on first use (about 35 s per 100 MB on 2 "
        "cores), or now with `posttrain import-model FILE OUT_DIR`"
    )


def _check_model_dir(text: str, path: Path) -> None:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"base_model {text!r}: {path} has no config.json, so it is not a saved model "
            f"directory; {MODEL_HINT}"
        )


def is_path_like(spec: str) -> bool:
    """Whether `spec` can only be a path: it starts like one (/ . ~), ends like a directory,
    or is not shaped like a hub id ("name" or "org/name"; a third part or a `\\` is a path)."""
    return (
        spec.startswith(("/", ".", "~")) or spec.endswith(("/", os.sep)) or not HUB_ID.match(spec)
    )


def check_base_model(spec: str | Path, *, timeout_s: float = HUB_TIMEOUT_S) -> None:
    """Raise unless `spec` names a model this process can load, without loading, converting or
    downloading anything.

    A directory must hold config.json; a path-like value that does not exist raises
    FileNotFoundError naming it; a hub id missing from the cache raises HubUnreachableError when
    the hub is off (HF_HUB_OFFLINE) or does not answer within `timeout_s`, and
    FileNotFoundError when it answers that there is no such model. A `.gguf` file must exist and
    start like one; a packaged model must be a known name; either needs the `gguf` package
    until it is converted (ModelSourceError otherwise).
    """
    text = str(spec)
    if text.startswith(PACKAGED_PREFIX):
        from posttrain.models.packaged import check_packaged_model

        check_packaged_model(text.removeprefix(PACKAGED_PREFIX))
        return
    if is_gguf(text):
        from posttrain.models.gguf import check_gguf_file

        check_gguf_file(text)
        return
    path = Path(text).expanduser()
    if path.exists():
        _check_model_dir(text, path)
        return
    if text.startswith("tiny:"):
        raise FileNotFoundError(
            f"base_model {text!r}: a tiny: spec is built by a `posttrain train` job or the server "
            "(`posttrain serve --base-model tiny:...`), not loaded here; build it with "
            "`posttrain make-tiny-model DIR` and pass DIR"
        )
    if isinstance(spec, Path) or is_path_like(text):
        raise FileNotFoundError(f"base_model path {text!r} does not exist; {MODEL_HINT}")
    check_hub_model(text, timeout_s=timeout_s)


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as set now, or as huggingface_hub read it."""
    from huggingface_hub import constants

    env = (
        os.environ.get(k, "").strip().lower() for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )
    return any(v in _TRUE for v in env) or bool(constants.HF_HUB_OFFLINE)


def in_hub_cache(repo_id: str) -> bool:
    """Whether the local Hugging Face cache holds the model's config (no network)."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def check_hub_model(repo_id: str, *, timeout_s: float = HUB_TIMEOUT_S) -> None:
    """A hub id: in the cache, else asked of the hub with one HEAD bounded by `timeout_s`."""
    if in_hub_cache(repo_id):
        return
    if hub_offline():
        raise HubUnreachableError(
            _no_copy(repo_id, "HF_HUB_OFFLINE is set, so the hub is not asked")
            + "; or unset HF_HUB_OFFLINE where there is network"
        )
    error = _head_config(repo_id, timeout_s)
    if error is None:
        return  # the hub has it: transformers downloads it when the model loads
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if isinstance(error, GatedRepoError):
        raise FileNotFoundError(
            f"base_model {repo_id!r} is gated on the Hugging Face hub: accept its terms on the "
            "model's page and log in (`hf auth login`, or set HF_TOKEN)"
        ) from error
    if isinstance(error, RepositoryNotFoundError):
        raise FileNotFoundError(
            f"base_model {repo_id!r} is neither a local directory nor a model on the Hugging Face "
            f"hub (or it is private: log in with `hf auth login`); {MODEL_HINT}"
        ) from error
    raise HubUnreachableError(
        _no_copy(repo_id, f"the hub did not answer ({error})")
        + "; or set HF_HUB_OFFLINE=1 to use only local copies"
    ) from error


def _no_copy(repo_id: str, why: str) -> str:
    # "org/name" is also a relative path: say so, for a directory name mistyped or not there.
    meant = (
        f" (if you meant a local directory: ./{repo_id} does not exist)" if "/" in repo_id else ""
    )
    return (
        f"base_model {repo_id!r} is not in the local Hugging Face cache and {why}{meant}. Get "
        f"it locally where there is network (`hf download {repo_id}` fills the cache), or save "
        "it to a directory and pass that path as base_model"
    )


def _head_config(repo_id: str, timeout_s: float) -> BaseException | None:
    """HEAD the model's config.json: None if the hub has it, else the error. The request runs
    in a daemon thread joined for `timeout_s`, so a DNS lookup that hangs cannot hold us."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    outcome: list[BaseException | None] = []

    def head() -> None:
        try:
            get_hf_file_metadata(hf_hub_url(repo_id, "config.json"), timeout=timeout_s)
            outcome.append(None)
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=head, name="posttrain-hub-check", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        return TimeoutError(f"no answer within {timeout_s:g}s")
    return outcome[0]
