"""The project's exceptions: one root, a few kinds, each message naming the problem and the fix.

The CLI prints `Error: <message>` for any `D3DError` and exits 1; anything else is a bug and keeps its
traceback.
"""


class D3DError(Exception):
    """Root of every error this tool raises on purpose (bad input, bad files, bad settings)."""


class ConfigError(D3DError):
    """A setting or a model config is invalid or inconsistent."""


class CheckpointError(D3DError):
    """A checkpoint folder is missing, incomplete, corrupted, or would be overwritten."""


class DiskFullError(CheckpointError):
    """The disk (or quota) filled while a file or folder was written; what was saved before is intact."""


class DataError(D3DError):
    """A prompt file or dataset cannot be read or does not fit the model."""


class CompatibilityError(D3DError):
    """A drafter and a target cannot be paired (tokenizer, vocabulary, block size)."""


def one_of(choices) -> str:
    """The choices of a setting for a message: "a", "a or b", "a, b or c"."""
    choices = [str(c) for c in choices]
    return choices[0] if len(choices) == 1 else f"{', '.join(choices[:-1])} or {choices[-1]}"
