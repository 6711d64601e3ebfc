"""Output helpers: results survive crashes (atomic, fsynced, previous version kept) and concurrent runs (a lock).

A results JSON is written to a temp file in the same folder, fsynced, and renamed over the old one, whose last
version stays as FILE.prev; then the folder is fsynced so the rename itself survives a power loss. Files get
the permissions the umask gives (0666 & ~umask), as `open()` would, and so does every file and folder of an
output folder (a checkpoint, a converted GGUF). One run at a time writes an output: a
second run into it fails at once, naming the pid that holds it (fcntl.flock on a sidecar lock file, released
by the kernel however the holder ends).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import OutputExistsError, QToolError


class OutputLockedError(QToolError):
    """Another process is writing the same output."""


def check_output(target: str | os.PathLike, overwrite: bool) -> None:
    if Path(target).exists() and not overwrite:
        raise OutputExistsError(f"output {target} already exists: choose another path or pass --overwrite")


def lock_path(target: str | os.PathLike) -> Path:
    target = Path(target)
    return target.with_name(f".{target.name}.lock")


class OutputLock:
    """An exclusive lock on `target`, held until release() or until the process ends."""

    def __init__(self, target: str | os.PathLike, *, wait: bool = False):
        self.target = Path(target)
        self.path = lock_path(self.target)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd: int | None = None
        while self.fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except OSError as e:
                holder = _read_pid(fd)
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                who = f"pid {holder}" if holder else "another process"
                raise OutputLockedError(f"{self.target} is being written by {who} (lock {self.path}): wait for that "
                                        "run to end or choose another output") from None
            # the holder before us may have removed the lock file after we opened it: lock the current file
            if _same_file(fd, self.path):
                self.fd = fd
            else:
                os.close(fd)
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f"{os.getpid()}\n".encode())

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)  # while still locked, so no one else is holding a lock on it
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


def _read_pid(fd: int) -> str:
    try:
        return os.pread(fd, 32, 0).decode().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def lock_output(target: str | os.PathLike, *, wait: bool = False) -> OutputLock:
    return OutputLock(target, wait=wait)


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temp folder beside `target`; on success it replaces `target`, on failure it is removed."""
    target = Path(target)
    check_output(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        follow_umask(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(target)
    fsync_dir(target.parent)


def current_umask() -> int:
    # /proc first: os.umask can only be read by setting it, which races with other threads creating files
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(folder: Path) -> None:
    """Give a finished output folder the modes the umask gives: mkdtemp makes it 0700, and libraries that write
    through temp files (safetensors' save_file) leave 0600 files, which other users could not read."""
    mask = current_umask()
    for root, _dirs, files in os.walk(folder):
        os.chmod(root, 0o777 & ~mask)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, (0o777 if os.access(path, os.X_OK) else 0o666) & ~mask)


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def previous_path(path: Path) -> Path:
    return path.with_name(f"{path.name}.prev")


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write JSON atomically and durably; the version it replaces is kept as PATH.prev."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    # os.open with 0o666 (not mkstemp's 0600): the umask decides, as for any file the user creates
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, default=str)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        if path.is_file() and path.stat().st_size > 0:
            prev_tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.prev")
            os.link(path, prev_tmp)  # a second name for the old version, then moved into place atomically
            os.replace(prev_tmp, previous_path(path))
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def read_results_json(path: str | os.PathLike) -> dict[str, Any]:
    """A results JSON to resume from; an empty or corrupt one is refused with the way back (PATH.prev)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        prev = previous_path(path)
        way = (f"its previous version is kept: `cp {prev} {path}` to resume from it, or pass --overwrite to start "
               "again" if prev.is_file() else "pass --overwrite to start again, or choose another --output")
        what = "empty" if path.stat().st_size == 0 else f"not valid JSON ({str(e).splitlines()[0]})"
        raise OutputExistsError(f"{path} is {what}, e.g. after a crash while writing: {way}") from None
    if not isinstance(data, dict):
        raise OutputExistsError(f"{path} is not a results JSON object: choose another --output or pass --overwrite")
    return data
