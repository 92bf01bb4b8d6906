"""Token ids to text, one step at a time, and stop strings (chapter: serving over HTTP).

A stream must neither send half a character nor send text that a stop string cuts off later.
:class:`Detokenizer` decodes a short window of recent tokens (the text of ``ids[prefix:]`` minus
that of ``ids[prefix:read]``: a token's leading space, or the rest of a multi-byte character,
depends on the tokens before it) and waits while the window ends in an incomplete character
(U+FFFD). It holds back the last ``len(longest stop string) - 1`` characters, which could be the
start of a stop string, until the following text shows they are not. When a stop string appears,
the text ends just before it (vLLM's rule) and ``stopped`` is set: the caller then ends the request
in the engine. Until ``min_tokens`` tokens are out no stop string counts; after that the search
looks back only as far as a stop string could reach into earlier text (vLLM's rule too). Without a tokenizer the text stays empty and only the ids count.
"""
from __future__ import annotations

INCOMPLETE = "\ufffd"  # what decoding part of a multi-byte character gives


class Detokenizer:
    """One request's text so far; :meth:`take` hands out the part that is safe to send."""

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = (), min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self.stopped = False  # a stop string ended the text
        self._prefix = self._read = 0  # the decode window: ids[prefix:read] are already text
        self._sent = 0  # characters handed out by take()

    def add(self, token_ids: list[int], finished: bool = False) -> None:
        """Decode the new tokens (all of them when ``finished``) and look for stop strings, one token
        at a time: a step that brings several (speculative decoding) reads as that many steps of
        one, so a stop string ends the text, and the ids, at the same token."""
        for i, token in enumerate(token_ids):
            self._add(token, finished and i == len(token_ids) - 1)

    def _add(self, token: int, finished: bool) -> None:
        if self.stopped:
            return
        self.token_ids.append(token)
        if self.tokenizer is None or self._read == len(self.token_ids):
            return
        before = self._decode(self._prefix, self._read)
        after = self._decode(self._prefix, len(self.token_ids))
        if not finished and (len(after) <= len(before) or after.endswith(INCOMPLETE)):
            return  # an incomplete character, or only special tokens: wait for more
        search_from = max(0, len(self.text) - self.hold)
        self.text += after[len(before):]
        self._prefix, self._read = self._read, len(self.token_ids)
        hits = [i for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if hits and len(self.token_ids) >= self.min_tokens:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def take(self, finished: bool = False) -> str:
        """The text not handed out yet, but for the tail a stop string might still begin with
        (all of it once finished or stopped)."""
        end = len(self.text) if finished or self.stopped else len(self.text) - self.hold
        if end <= self._sent:
            return ""
        delta, self._sent = self.text[self._sent:end], end
        return delta

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=True)
