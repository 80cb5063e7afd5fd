"""Progress bars on stderr (rich), silent when nobody watches."""

import contextlib
import sys


@contextlib.contextmanager
def progress_bar(description: str, total: int, enabled: bool = True):
    """Yield an `advance(n=1)` callable; draws a bar on stderr only when `enabled`."""
    if not enabled:
        yield lambda n=1: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(file=sys.stderr), transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n=1: progress.advance(task, n)
