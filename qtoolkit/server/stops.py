"""Streaming around stop strings: hold back the tail of the text that could still grow into a stop string.

The engine finds a stop string in the window the new text can complete (bounded look-back) and cuts the text
before it. A stream that sent text as it was decoded would already have sent the stop string's first
characters ('1\\ndef' for stop "\\ndef " and final text '1'); holding back any tail that is a proper prefix of a
stop string until the next token decides it makes the concatenated stream equal the final text, as in vLLM.
"""

from __future__ import annotations


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `stops`."""
    best = 0
    for stop in stops:
        start = max(0, len(text) - len(stop) + 1)
        i = text.find(stop[0], start)
        while i != -1 and len(text) - i > best:
            if stop.startswith(text[i:]):
                best = len(text) - i  # the earliest start that matches is this stop's longest tail
                break
            i = text.find(stop[0], i + 1)
    return best


class StreamCursor:
    """How much of one choice's text has been sent; `advance` returns the next piece that is safe to send."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.sent = 0

    def advance(self, text: str, finished: bool) -> str:
        safe = len(text) if finished or not self.stops else len(text) - held_back(text, self.stops)
        if safe <= self.sent:
            return ""
        piece, self.sent = text[self.sent:safe], safe
        return piece
