"""The model cache: where built, converted and fetched models live, and how an entry gets there
whole: a lock per entry (`exclusive`), a temporary directory renamed into place (`publish_dir`),
JSON records written through a rename. The errors a model source raises live here too, so that
the sources (directory, hub, GGUF, packaged) import this and not each other.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

Echo = Callable[[str], None]
_CHUNK = 1 << 20


class HubUnreachableError(ConnectionError):
    """A hub id that is not in the local cache, while the hub cannot be asked for it."""


class ModelSourceError(ValueError):
    """A base model that cannot be made into a model directory: a GGUF file that is corrupt or
    that transformers cannot read, an unknown packaged model, a failed download, a missing
    package. The message names the file or package and the fix."""


def cache_root() -> Path:
    """`$POSTTRAIN_CACHE`, else `~/.cache/posttrain`: where built and converted models live."""
    root = os.environ.get("POSTTRAIN_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "posttrain"


def say(message: str) -> None:
    """Progress of a download or conversion, on stderr (stdout stays the command's output)."""
    print(f"posttrain: {message}", file=sys.stderr, flush=True)


def sha256_file(path: Path) -> str:
    """The sha256 of the file's bytes, as `sha256sum` prints it."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def new_dir(path: str | Path) -> Path:
    """`path`, which must not exist or be an empty directory (an output is never merged)."""
    out = Path(path).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not empty; give a new directory")
    return out


def copy_model_dir(source: Path, out_dir: str | Path) -> Path:
    """Copy the model directory `source` to `out_dir` (new or empty), whole or not at all."""
    return publish_dir(
        new_dir(out_dir), lambda tmp: shutil.copytree(source, tmp, dirs_exist_ok=True)
    )


def publish_dir(final: Path, build: Callable[[Path], object]) -> Path:
    """Run `build` on a fresh temporary directory beside `final`, then rename it to `final`:
    `final` is whole or absent, whatever happens to this process. A `final` that another process
    published meanwhile is kept, and ours dropped."""
    final.parent.mkdir(parents=True, exist_ok=True)
    # mkdir, not mkdtemp: the directory gets the umask's permissions, not mkdtemp's 0700.
    tmp = final.parent / f".{final.name}.partial-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        build(tmp)
        try:
            tmp.rename(final)
        except OSError:
            if not (final.is_dir() and any(final.iterdir())):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


@contextmanager
def exclusive(lock: Path, doing: str, echo: Echo = say) -> Iterator[None]:
    """Hold an exclusive lock on the file `lock` (POSIX); say so if another process holds it.

    Where there is no `fcntl` (Windows) this only yields: the atomic rename in `publish_dir`
    still keeps every entry whole, at the cost of converting twice in a race.
    """
    try:
        import fcntl
    except ImportError:
        yield
        return
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            echo(f"waiting for another process that is {doing}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def write_json(path: Path, value: dict[str, object]) -> None:
    """Write `value` to `path` through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)
