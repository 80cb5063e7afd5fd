"""Progress on stderr: a rich bar on a terminal, a plain line now and then in a log file."""

import contextlib
import sys
import time

LOG_EVERY_S = 60.0  # off a terminal (batch jobs, CI logs), at most one progress line per this many seconds


@contextlib.contextmanager
def progress_bar(description: str, total: int, enabled: bool = True, log_every_s: float = LOG_EVERY_S):
    """Yield an `advance(n=1, total=None)` callable that reports progress on stderr when `enabled`; a `total`
    replaces the expected total (work that turned out larger or smaller than planned).

    On a terminal it draws a bar; otherwise it writes `description: done/total (elapsed, ETA)` lines, at
    most one per `log_every_s` seconds and, once one was written, one at the end: a long job's log shows
    it is alive, a short one stays quiet.
    """
    if not enabled:
        yield lambda n=1, total=None: None
        return
    if not sys.stderr.isatty():
        yield _line_reporter(description, total, log_every_s)
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(file=sys.stderr), transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n=1, total=None: progress.update(task, advance=n, total=total)  # rich: total None = unchanged


def _line_reporter(description: str, total: int, every_s: float):
    start = last = time.monotonic()
    done, planned, written = 0, total, False

    def advance(n: int = 1, total: int | None = None) -> None:
        nonlocal done, planned, last, written
        done += n
        planned = planned if total is None else total
        now = time.monotonic()
        if n and (now - last >= every_s or (written and done >= planned)):
            last, written = now, True
            elapsed = now - start
            eta = elapsed / done * max(0, planned - done) if done else 0.0
            print(f"{description}: {done}/{planned} ({clock(elapsed)} elapsed, {clock(eta)} left)", file=sys.stderr,
                  flush=True)

    return advance


def clock(seconds: float) -> str:
    """`seconds` of wall time as M:SS."""
    minutes, seconds = divmod(int(round(seconds)), 60)
    return f"{minutes}:{seconds:02d}"
