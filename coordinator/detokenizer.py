"""Incremental detokenisation that only emits complete characters, and stop strings."""

from __future__ import annotations

from typing import Any

CONTEXT_TOKENS = 5  # prompt tokens decoded alongside, so leading spaces come out right
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a character.

    A delta is emitted only when the decoded text grew and does not end in a
    replacement character (an incomplete UTF-8 sequence); `flush` emits the rest.
    """

    def __init__(self, tokenizer: Any, context_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(context_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token: int) -> str:
        self.ids.append(token)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return new_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text):]


class StopStrings:
    """Finds stop strings in the generated text; holds back what could start one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.holdback = max((len(s) for s in self.stops), default=1) - 1

    def find(self, text: str, searched_up_to: int) -> int:
        """Index where the earliest stop string starts in text, or -1. Only text that could
        contain a match not seen before (from searched_up_to - holdback) is scanned."""
        start = max(0, searched_up_to - self.holdback)
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits, default=-1)

    def safe_length(self, text: str) -> int:
        """How much of text can be streamed without risking part of a stop string."""
        return len(text) - self.holdback if self.stops else len(text)
