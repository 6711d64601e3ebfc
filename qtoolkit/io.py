"""Output helpers: results survive crashes (atomic, fsynced, previous version kept) and concurrent runs (a lock).

A results JSON is written to a temp file in the same folder, fsynced, and renamed over the old one, whose last
version stays as FILE.prev; then the folder is fsynced so the rename itself survives a power loss. An output
folder is built beside its target and swapped in with one atomic exchange (renameat2 RENAME_EXCHANGE), so a
kill at any moment leaves either the old or the new folder, never none; temp files and folders carry their
writer's pid, and those of dead writers are removed by the next write. A write that fails (a full disk, a
file-size or quota limit) is one OutputWriteError naming the path, and what was there before is intact. Files get
the permissions the umask gives (0666 & ~umask), as `open()` would, and so does every file and folder of an
output folder (a checkpoint, a converted GGUF). One run at a time writes an output: a
second run into it fails at once, naming the pid that holds it (fcntl.flock on a sidecar lock file, released
by the kernel however the holder ends).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import glob
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .errors import OutputExistsError, OutputWriteError, QToolError

# errnos that mean "no room": the fix is space (or a higher limit), not permissions
NO_ROOM = {errno.ENOSPC: "no space left on the disk", errno.EDQUOT: "the disk quota is exhausted",
           errno.EFBIG: "the file-size limit is reached (ulimit -f)"}
# the same, as libraries that wrap the OSError in their own exception word it (safetensors, torch)
_NO_ROOM_TEXT = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
                 "File too large": errno.EFBIG}


def no_room(e: BaseException) -> str | None:
    """What ran out, when `e` is a write that found no room (an OSError or a library's wrapper of one)."""
    if isinstance(e, OSError) and e.errno in NO_ROOM:
        return NO_ROOM[e.errno]
    text = str(e)
    return next((NO_ROOM[code] for needle, code in _NO_ROOM_TEXT.items() if needle in text), None)


def write_error(path: str | os.PathLike, e: BaseException) -> OutputWriteError:
    """One line naming the path, what failed and the fix."""
    if room := no_room(e):
        return OutputWriteError(f"cannot write {path}: {room}: free space there (or raise the limit) and run the "
                                "same command again; what was written before is intact")
    why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
    return OutputWriteError(f"cannot write {path}: {why}: make it writable or choose another output; what was "
                            "written before is intact")


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
    """Yield a temp folder beside `target`; on success it replaces `target` atomically, on failure it is removed
    and `target` is left as it was (a write that found no room: OutputWriteError naming `target`)."""
    target = Path(target)
    check_output(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
    try:
        yield tmp
        follow_umask(tmp)
        _swap_in(tmp, target)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if no_room(e):
            raise write_error(target, e) from e
        raise
    fsync_dir(target.parent)


def _swap_in(tmp: Path, target: Path) -> None:
    if not target.exists():
        tmp.rename(target)
        return
    if _exchange(tmp, target):  # one step: there is no moment without a complete target
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old version
        return
    old = target.with_name(f".{target.name}.old-{os.getpid()}")  # remove_stale puts it back if we die here
    target.rename(old)
    try:
        tmp.rename(target)
    except BaseException:
        old.rename(target)
        raise
    shutil.rmtree(old, ignore_errors=True)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not Linux, or a libc older than glibc 2.28
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically; False where the system or the filesystem cannot."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _started_after(pid: int, when: float) -> bool:
    """Process `pid` started after the epoch time `when` (so it is not the one that wrote a file then: pids are
    reused, 32768 of them by default); False where /proc cannot say."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return False
    return boot + ticks / os.sysconf("SC_CLK_TCK") > when + 1.0  # btime is whole seconds


def _dead_writer(path: Path, marker: str) -> bool:
    """`path` is named NAME<marker>PID..., and no process PID is alive (it was killed mid-write), or the one alive
    under that pid started after `path` was last written (a reused pid)."""
    pid = path.name.rpartition(marker)[2].split("-")[0].split(".")[0]
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    if not _pid_alive(int(pid)):
        return True
    with contextlib.suppress(OSError):
        return _started_after(int(pid), path.lstat().st_mtime)
    return False


def remove_stale(target: Path) -> None:
    """Clear what a killed writer of `target` left beside it: its temp folders and files go; an old version it
    had moved aside without putting the new one in place goes back (the non-atomic fallback's window)."""
    name = glob.escape(target.name)
    old = sorted(p for p in target.parent.glob(f".{name}.old-*") if _dead_writer(p, ".old-"))
    if old and not target.exists():
        with contextlib.suppress(OSError):
            old.pop().rename(target)
    folders = old + [p for p in target.parent.glob(f".{name}.tmp-*") if _dead_writer(p, ".tmp-")]
    for p in folders:
        shutil.rmtree(p, ignore_errors=True)
    for p in target.parent.glob(f".{name}.*.tmp"):
        if _dead_writer(p, f".{target.name}."):
            with contextlib.suppress(OSError):
                p.unlink()


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
    return write_text(path, json.dumps(data, indent=2, default=str) + "\n", keep_previous=True)


def write_text(path: str | os.PathLike, text: str, *, keep_previous: bool = False) -> Path:
    """Write `text` atomically and durably: a reader sees the old file or the new one, never a part. A failed write
    is an OutputWriteError naming `path`, with the old file intact."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(path)
        # os.open with 0o666 (not mkstemp's 0600): the umask decides, as for any file the user creates
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as e:
        raise write_error(path, e) from e
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if keep_previous and path.is_file() and path.stat().st_size > 0:
            prev_tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.prev.tmp")
            os.link(path, prev_tmp)  # a second name for the old version, then moved into place atomically
            os.replace(prev_tmp, previous_path(path))
            # renaming onto another name of the same file does nothing (POSIX), so where PATH.prev already is PATH
            # (a writer killed between its two renames) the temporary name is still there: drop it
            with contextlib.suppress(FileNotFoundError):
                os.unlink(prev_tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise write_error(path, e) from e
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
