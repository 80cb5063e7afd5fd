"""One process per output: a lock beside the output folder, naming the process that holds it.

`output_lock(OUT)` holds an exclusive `flock` on the hidden file `.OUT.lock` next to `OUT` for the length
of its block and writes the holder's pid, host and command line into it; `prune run`, `prune distill` and
`prune train-drafter` take it before they write anything. A second process on the same output fails at
once with a CheckpointError naming the holder. The kernel drops a flock when its process dies, even by
SIGKILL, so a lock file left by a killed process is stale: the next process takes it over (and says whose it
was). On a file system without flock (it answers ENOLCK or EOPNOTSUPP) the file's pid decides instead: a
pid alive on this host, or any pid on another host, holds the output. The file is removed on leaving.
Leftover temporary entries of killed atomic writes of the output (models.checkpoint.remove_partials) are
removed once the lock is held.
"""

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from .checkpoint import remove_partials
from .errors import CheckpointError

UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


def lock_file(path: str | os.PathLike) -> Path:
    """The lock file of output `path`: `.NAME.lock` in the same folder (absolute, symbolic links resolved)."""
    path = Path(path).resolve()
    return path.with_name(f".{path.name}.lock")


@contextlib.contextmanager
def output_lock(path: str | os.PathLike, log=None):
    """Hold the lock of output `path` (a folder or file, existing or not) for the block.

    Raises CheckpointError (one line: the holder's pid, host and command, and what to do) when another
    live process holds it. `log(message)` hears about a stale lock taken over (default: stderr).
    """
    file = lock_file(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    fd, previous = _acquire(file, Path(path))
    try:
        if previous and previous.get("pid") != os.getpid():
            (log or _stderr)(f"note: took over the stale lock of {path} left by pid {previous.get('pid')} on "
                             f"{previous.get('host')} (no longer running)")
        remove_partials(path)
        yield file
    finally:
        with contextlib.suppress(OSError):
            if os.path.samestat(os.stat(file), os.fstat(fd)):
                file.unlink()
        os.close(fd)


def _acquire(file: Path, path: Path) -> tuple[int, dict | None]:
    """Open and lock `file`; returns (its descriptor, the record of the previous, dead holder or None)."""
    while True:
        fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            holder = _read(fd)
            if not _flock(fd, holder):
                raise CheckpointError(f"{path} is in use by {_describe(holder)}; wait for it to end or stop it, "
                                      f"then rerun (if it is gone, delete {file})")
            if not os.path.samestat(os.stat(file), os.fstat(fd)):
                raise FileNotFoundError  # the holder removed the file while we waited: lock the new one
        except FileNotFoundError:
            os.close(fd)
            continue
        except BaseException:
            os.close(fd)
            raise
        _write(fd)
        return fd, holder


def _flock(fd: int, holder: dict | None) -> bool:
    """Take the flock of `fd` without waiting; True when this process now holds the output."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno not in UNSUPPORTED:
            raise
        return holder is None or holder.get("pid") == os.getpid() or not _alive(holder)


def _alive(holder: dict) -> bool:
    """Whether the process a lock record names may still run (only this host's pids can be checked)."""
    if holder.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, KeyError, TypeError, ValueError):
        return True
    return True


def _read(fd: int) -> dict | None:
    """The lock record in `fd` ({pid, host, command, started}), or None when empty or unreadable."""
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"null")
    except ValueError:
        return None


def _write(fd: int) -> None:
    record = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv)[:300],
              "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)


def _describe(holder: dict | None) -> str:
    if not holder:
        return "another process (it has not written its pid yet)"
    return (f"another process: pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')} "
            f"({holder.get('command')})")


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
