"""Streaming detokenization: text pieces for token ids fed as a decoder commits them.

Token ids do not map to text one at a time: a byte-level BPE token may hold part of a multi-byte UTF-8
character (decoded alone it reads U+FFFD), and SentencePiece-style tokenizers drop or keep a token's
leading space depending on what precedes it. So `TextStream` decodes a short window of ids - the ids of
the last emitted piece, as context, plus the new ones - and emits the text the new ids add to it. It
holds text back while it ends in an incomplete character, and `finish()` releases what is left. Each
push decodes only that window, so streaming costs the same per token however long the reply grows.
"""

REPLACEMENT = "\ufffd"  # what an incomplete UTF-8 sequence decodes to


class TextStream:
    """Turns token ids, fed in order, into text pieces whose concatenation is the decoded text.

    Args:
        tokenizer: a transformers tokenizer (anything with `decode(ids, skip_special_tokens=...)`).
        skip_special_tokens: leave special tokens (EOS, chat markers) out of the text, as the reply shows.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.context = 0  # ids[context:emitted] were emitted with the last piece: decoded again as context
        self.emitted = 0  # ids before this index are emitted as text

    def push(self, ids: list[int]) -> str:
        """Feed the next committed ids; returns the text they complete ('' while a character is incomplete)."""
        self.ids.extend(ids)
        return self._piece(final=False)

    def finish(self) -> str:
        """The text held back at the end (an incomplete character, as the tokenizer decodes it)."""
        return self._piece(final=True)

    def _piece(self, final: bool) -> str:
        before = self._decode(self.ids[self.context : self.emitted])
        after = self._decode(self.ids[self.context :])
        if len(after) <= len(before) or (after.endswith(REPLACEMENT) and not final):
            return ""
        self.context, self.emitted = self.emitted, len(self.ids)
        return after[len(before) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""
