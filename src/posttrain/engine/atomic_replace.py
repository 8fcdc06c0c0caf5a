"""Put a fully written directory in place of another so that its name never goes missing.

A checkpoint is written to a hidden sibling `.NAME.tmp-*` and then published under NAME. When
NAME already holds a checkpoint, the two must trade places without a moment where NAME holds
neither, since a process can be killed at any instant and the name is what readers look up:

- On Linux, `renameat2(RENAME_EXCHANGE)` swaps the two directories in one atomic step; the old
  one, now under the temporary name, is deleted afterwards. NAME is always old or new.
- Elsewhere (or on a filesystem without the exchange), NAME is renamed to `.NAME.old-<hex>`,
  then the new one to NAME. A kill between the two leaves NAME missing and the old checkpoint
  complete under `.NAME.old-*`; `recover` puts it back. Readers therefore call `recover`
  before they look at NAME, and writers before they write.

Within one process, saves, loads and recovery of one name are serialised by `name_lock`, so a
reader never recovers a name mid-publish, nor reads half from the old files and half from the
new. Across processes, a directory of checkpoints has one writer.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import re
import shutil
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
# errnos that mean "this kernel or filesystem cannot exchange": use the two-rename path.
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM}

_locks: dict[str, threading.RLock] = {}
_locks_guard = threading.Lock()
_writing: set[str] = set()  # temporary directories being written in this process


@contextlib.contextmanager
def name_lock(final: Path) -> Iterator[None]:
    """Hold the in-process lock of one checkpoint name (re-entrant)."""
    key = os.path.abspath(final)
    with _locks_guard:
        lock = _locks.setdefault(key, threading.RLock())
    with lock:
        yield


@contextlib.contextmanager
def writing(tmp: Path) -> Iterator[None]:
    """Mark `tmp` as being written, so `remove_debris` leaves it alone."""
    key = os.path.abspath(tmp)
    with _locks_guard:
        _writing.add(key)
    try:
        yield
    finally:
        with _locks_guard:
            _writing.discard(key)


def publish(tmp: Path, final: Path) -> None:
    """Move the complete directory `tmp` to `final`, replacing what is there (hold the lock)."""
    if not os.path.lexists(final):
        os.rename(tmp, final)
        fsync_dir(final.parent)
        return
    if _exchange(tmp, final):  # final is new now, and tmp holds the old checkpoint
        fsync_dir(final.parent)
        shutil.rmtree(tmp, ignore_errors=True)  # a kill here leaves debris, never a gap
        return
    old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex}")
    os.rename(final, old)
    try:
        os.rename(tmp, final)
    except BaseException:
        os.rename(old, final)
        raise
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)  # recovery deletes what a kill leaves of it


def old_copies(final: Path) -> list[Path]:
    """The `.NAME.old-*` directories an interrupted replacement of `final` left behind."""
    pattern = re.compile(rf"\.{re.escape(final.name)}\.old-[0-9a-f]{{32}}")
    try:
        entries = list(final.parent.iterdir())
    except FileNotFoundError:
        return []
    return [p for p in entries if pattern.fullmatch(p.name)]


def recover(final: Path, is_complete: Callable[[Path], bool]) -> None:
    """Undo what a kill mid-replacement left: when `final` is missing or incomplete and a
    complete old copy exists, put the old copy back; then delete the remaining old copies.

    Hold `name_lock(final)`.
    """
    olds = old_copies(final)
    if not olds:
        return
    if not is_complete(final):
        good = [p for p in olds if is_complete(p)]
        if good:
            # One at most in practice (each save recovers first); if several, the newest.
            keep = max(good, key=lambda p: p.stat().st_mtime_ns)
            if os.path.lexists(final):  # incomplete: set aside as debris, deleted below
                olds.append(final.rename(final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex}")))
            os.rename(keep, final)
            fsync_dir(final.parent)
            olds.remove(keep)
    for old in olds:
        shutil.rmtree(old, ignore_errors=True)


def remove_debris(directory: Path, names: Callable[[str], bool]) -> None:
    """Delete hidden `.NAME.tmp-*` and `.NAME.deleting-*` directories for the names that
    `names` accepts, except those this process is writing now."""
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return
    for entry in entries:
        match = re.fullmatch(r"\.(.+)\.(?:tmp|deleting)-[^.]+", entry.name)
        if match is None or not names(match.group(1)):
            continue
        with _locks_guard:
            busy = os.path.abspath(entry) in _writing
        if not busy:
            shutil.rmtree(entry, ignore_errors=True)


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (only POSIX can open and fsync a directory)."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically; False where the system cannot (nothing changed)."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NO_EXCHANGE:
        return False
    raise OSError(code, f"cannot swap {b} with its new version: {os.strerror(code)}", str(b))


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    """libc's renameat2 (glibc >= 2.28) on Linux, else None."""
    if sys.platform != "linux":
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fd, name = ctypes.c_int, ctypes.c_char_p
    function.argtypes = [fd, name, fd, name, ctypes.c_uint]  # olddirfd, old, newdirfd, new, flags
    function.restype = ctypes.c_int
    return function
