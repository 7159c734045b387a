"""The text a request streams: whole UTF-8 characters, cut before a stop string, and never the
start of a stop string that may still complete in a later round."""

from __future__ import annotations

from typing import Any, Sequence

from coordinator.detokenizer import IncrementalDetokenizer, StopStrings
from coordinator.rounds import FinishReason


class StreamedText:
    def __init__(self, tokenizer: Any, history: Sequence[int], stop: Sequence[str]):
        self.detokenizer = IncrementalDetokenizer(tokenizer, history)
        self.stops = StopStrings(stop)
        self.text = ""      # the request's text so far (cut before a stop string)
        self.streamed = 0   # characters of it already streamed
        self.searched = 0   # characters of it already searched for stop strings

    def add(self, token: int) -> bool:
        """Append a token's text; True when that completed a stop string (the text ends before it)."""
        self.text += self.detokenizer.add(token)
        hit = self.stops.find(self.text, self.searched)
        if hit >= 0:
            self.text = self.text[:hit]
            return True
        self.searched = len(self.text)
        return False

    def delta(self, finish: FinishReason | None) -> tuple[str, FinishReason | None]:
        """The text to stream now and the finish reason: while running, all but what may be the
        start of a stop string; at the end, everything (the last characters may still complete a
        stop string, which then becomes the finish reason)."""
        if finish is None:
            end = self.stops.safe_length(self.text)
        else:
            if finish != FinishReason.STOP:
                self.text += self.detokenizer.flush()
                hit = self.stops.find(self.text, self.searched)
                if hit >= 0:
                    self.text, finish = self.text[:hit], FinishReason.STOP
            end = len(self.text)
        out = self.text[self.streamed:end] if end > self.streamed else ""
        self.streamed = max(self.streamed, end)
        return out, finish
