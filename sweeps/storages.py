"""Study storages by URL: the one table of storage schemes that `make_storage` and `prune sweep --help` read.

`sqlite:///path.db` (the default, a file under OUT) for workers on one machine; `postgresql://...` or
`mysql+pymysql://...` for workers on many; `journal:PATH` (or a path ending in .log/.journal) for a journal
file on a shared file system. A plain path ending in .db/.sqlite/.sqlite3 is a SQLite file, and any other
`scheme://` URL is handed to SQLAlchemy as it is. Database storages get heartbeats: a worker's running trial
records one every `heartbeat` seconds; a trial silent for `grace` seconds (its worker was killed or lost) is
marked FAIL by the next worker that looks and re-queued once more with the same parameters (Optuna's
RetryHeartbeatStaleTrialCallback). Journal files have no heartbeats.

Adding a scheme is one entry of SCHEMES plus its opener. Optuna is imported only when a storage is opened.
"""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from models.errors import ConfigError


@dataclass(frozen=True)
class Options:
    """How to open a storage.

    Attributes:
        heartbeat: seconds between a running trial's heartbeats (None or 0: no heartbeats).
        grace: seconds without a heartbeat before a trial counts as dead (None: 3 x heartbeat).
        max_retry: times a dead trial is re-queued.
        attempts: tries to open a database that other workers are creating at the same moment.
    """

    heartbeat: int | None = 30
    grace: int | None = None
    max_retry: int = 1
    attempts: int = 5


@dataclass(frozen=True)
class StorageScheme:
    """One kind of storage.

    Attributes:
        name: what it is; example: its URL form, for --help.
        prefixes: URLs starting so are this scheme; suffixes: so are plain paths ending so.
        url: function(given URL or path) -> the URL the opener takes.
        opener: function(URL, Options) -> an Optuna storage.
    """

    name: str
    example: str
    prefixes: tuple[str, ...]
    suffixes: tuple[str, ...]
    url: Callable[[str], str]
    opener: Callable[[str, Options], object]


def _sqlite_url(given: str) -> str:
    return given if "://" in given else f"sqlite:///{Path(given).expanduser().resolve()}"


def _open_sqlite(url: str, options: Options):
    Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return _open_database(url, options, {"connect_args": {"timeout": 60}})  # wait for other workers' writes


def _open_server(url: str, options: Options):
    return _open_database(url, options, {"pool_pre_ping": True})


def _open_journal(url: str, options: Options):
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock, JournalStorage

    path = Path(url.removeprefix("journal:")).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    # The open(O_EXCL) lock works on NFS and other shared file systems.
    return JournalStorage(JournalFileBackend(str(path), lock_obj=JournalFileOpenLock(str(path))))


def _same(url: str) -> str:
    return url


SCHEMES = (
    StorageScheme("sqlite", "sqlite:///FILE", ("sqlite:///",), (".db", ".sqlite", ".sqlite3"), _sqlite_url,
                  _open_sqlite),
    StorageScheme("postgresql", "postgresql://...", ("postgresql://", "postgres://"), (),
                  lambda url: "postgresql://" + url.split("://", 1)[1], _open_server),
    StorageScheme("mysql", "mysql+pymysql://...", ("mysql://", "mysql+"), (), _same, _open_server),
    StorageScheme("journal", "journal:FILE", ("journal:",), (".log", ".journal"), _same, _open_journal),
)
OTHER = StorageScheme("database", "any other SQLAlchemy URL", (), (), _same, _open_server)


def scheme_of(given: str) -> StorageScheme:
    """The scheme of a --storage value: by its URL prefix, any other `scheme://` URL as a database, else a
    plain path by its ending (ConfigError naming the forms when none fits)."""
    for scheme in SCHEMES:
        if given.startswith(scheme.prefixes):
            return scheme
    if "://" in given:
        return OTHER
    for scheme in SCHEMES:
        if scheme.suffixes and given.endswith(scheme.suffixes):
            return scheme
    raise ConfigError(f"--storage {given!r} is neither a URL nor a .db / .log file; e.g. sqlite:///study.db, "
                      "postgresql://user:pass@host/db or journal:study.log")


def make_storage(given: str, heartbeat: int | None = Options.heartbeat, grace: int | None = None,
                 max_retry: int = Options.max_retry, attempts: int = Options.attempts):
    """An Optuna storage for a URL or path (see the module docstring); `heartbeat` None or 0 disables heartbeats."""
    scheme = scheme_of(given)
    return scheme.opener(scheme.url(given), Options(heartbeat, grace, max_retry, attempts))


def examples() -> str:
    """The URL forms of the schemes, for --help."""
    return ", ".join(scheme.example for scheme in SCHEMES)


def redact(url: str) -> str:
    """The URL without its password, for messages."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def _open_database(url: str, options: Options, engine_kwargs: dict):
    """An RDBStorage (SQLAlchemy) with heartbeats unless off; workers that race to create the tables retry."""
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

    from ._optuna import quiet_optuna  # imports optuna

    heartbeat = options.heartbeat or None
    for attempt in range(options.attempts):
        try:
            with quiet_optuna():
                return RDBStorage(url, engine_kwargs=engine_kwargs, heartbeat_interval=heartbeat,
                                  grace_period=(options.grace or 3 * heartbeat) if heartbeat else None,
                                  heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(
                                      max_retry=options.max_retry) if heartbeat else None)
        except ImportError as exc:
            raise ConfigError(f"the storage {redact(url)} needs a database driver ({exc}); for PostgreSQL pip "
                              "install 'psycopg[binary]', for MySQL use mysql+pymysql:// and pip install PyMySQL"
                              ) from None
        except Exception as exc:  # noqa: BLE001 - sqlalchemy's errors: unreachable server, bad URL, ...
            # Workers that start together on a fresh database race to create its tables; the losers retry.
            text = f"{type(exc).__name__} {exc}"[:400]
            if attempt + 1 < options.attempts and any(m in text for m in ("IntegrityError", "already exists",
                                                                           "duplicate key")):
                time.sleep(0.5 * (attempt + 1))
                continue
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"cannot open the storage {redact(url)}: {first}") from None
