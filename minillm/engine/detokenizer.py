"""Token ids to text, one step at a time, and stop strings (chapters 一次请求的一生 and 调度).

A stream must neither send half a character nor send text that a stop string cuts off later.
:class:`Detokenizer` decodes a short window of recent tokens (the text of ``ids[prefix:]`` minus
that of ``ids[prefix:read]``: a token's leading space, or the rest of a multi-byte character,
depends on the tokens before it) and waits while the window ends in an incomplete character
(U+FFFD). It holds back the last ``len(longest stop string) - 1`` characters, which could be the
start of a stop string, until the following text shows they are not. When a stop string appears,
the text ends just before it (vLLM's rule) and :meth:`add` says so: the scheduler then finishes
the request with reason "stop". Until ``min_tokens`` tokens are out no stop string counts; after
that the search looks back only as far as a stop string could reach into earlier text (vLLM's rule
too). Without stop strings nothing is decoded before :meth:`take` asks, so a step pays for no text
nobody reads. Without a tokenizer the text stays empty and only the ids count.
"""
from __future__ import annotations

INCOMPLETE = "\ufffd"  # what decoding part of a multi-byte character gives


class Detokenizer:
    """One request's text so far; :meth:`take` hands out the part that is safe to send."""

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = (), min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens
        self.stop = [s for s in stop if s] if tokenizer is not None else []
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self.stopped = False  # a stop string ended the text
        self.finished = False  # no more tokens come: the text is final
        self._prefix = self._read = 0  # the decode window: ids[prefix:read] are already text
        self._sent = 0  # characters handed out by take()

    def add(self, token_ids: list[int]) -> bool:
        """Take the new tokens, one at a time: a step that brings several (speculative decoding)
        reads as that many steps of one, so a stop string ends the text, and the ids, at the same
        token. Returns whether a stop string has ended the text."""
        for token in token_ids:
            if self.stopped:
                break
            self.token_ids.append(token)
            if self.stop:
                self._look_for_stop()
        return self.stopped

    def finish(self) -> None:
        """No more tokens: decode the rest, even a broken character at the end."""
        if not self.stopped and self.tokenizer is not None:
            self._decode_to(len(self.token_ids), force=True)
        self.finished = True

    def take(self) -> str:
        """The text not handed out yet, but for the tail a stop string might still begin with
        (all of it once finished or stopped)."""
        if self.tokenizer is None:
            return ""
        if not (self.stopped or self.finished or self.stop):
            self._decode_to(len(self.token_ids))
        end = len(self.text) if self.finished or self.stopped else len(self.text) - self.hold
        if end <= self._sent:
            return ""
        delta, self._sent = self.text[self._sent:end], end
        return delta

    @property
    def sent(self) -> str:
        """The text :meth:`take` has handed out so far."""
        return self.text[:self._sent]

    def _look_for_stop(self) -> None:
        search_from = max(0, len(self.text) - self.hold)
        if not self._decode_to(len(self.token_ids)):
            return
        hits = [i for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if hits and len(self.token_ids) >= self.min_tokens:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def _decode_to(self, end: int, force: bool = False) -> bool:
        """Append the text of ``ids[read:end]``; unless ``force``, wait (False) while it ends in an
        incomplete character or is empty (only special tokens)."""
        if self._read == end:
            return False
        before = self._decode(self._prefix, self._read)
        after = self._decode(self._prefix, end)
        if not force and (len(after) <= len(before) or after.endswith(INCOMPLETE)):
            return False
        self.text += after[len(before):]
        self._prefix, self._read = self._read, end
        return True

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=True)
