"""Stop-string matching over streamed text.

Generated text arrives one detokenized piece at a time, and a stop string may be split over
any number of pieces. `StopMatcher` holds back just enough text to never emit the beginning of
a stop string that may still complete, and never emits any part of a stop string that does.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxr.errors import MlxrError


class StopMatcher:
    """Incremental matcher for a set of stop strings.

    Feed text pieces in order with `feed`; it returns ``(text safe to emit now, stopped)``.

    * Text that could be the beginning of a stop string (the longest suffix of the pending text
      that is a prefix of some stop string) is held back until it either completes a stop
      string or stops being a possible prefix.
    * Generation stops as soon as any stop string is complete. If several are complete in the
      pending text, the one that ends first wins (ties: the one that starts first, i.e. the
      longest). This makes the result independent of how the text is split into pieces: feeding
      character by character or all at once gives the same output.
    * On a stop, `feed` returns the text before the stop string (the stop string itself is
      never emitted) and ``True``; later `feed` calls return ``("", True)`` and `flush` returns
      ``""``.
    * At the end of generation (no stop), `flush` releases the held-back text.

    With no stop strings, every piece passes straight through.
    """

    def __init__(self, stops: Sequence[str]):
        if isinstance(stops, str):
            stops = (stops,)
        stops = tuple(stops)
        for i, s in enumerate(stops):
            if not isinstance(s, str):
                raise MlxrError(f"stop[{i}]: stop strings must be str, got {type(s).__name__}")
            if not s:
                raise MlxrError(f"stop[{i}]: stop strings must not be empty")
        # Deduplicate, keep order (order does not affect results).
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self._max_len = max((len(s) for s in self.stops), default=0)
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that fired, if any

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        for k in range(min(len(text), self._max_len - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def feed(self, text: str) -> tuple[str, bool]:
        """Add the next piece of text; return (text safe to emit now, stopped?)."""
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self._pending + text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self.stops:
            start = buf.find(s)
            if start >= 0:
                cand = (start + len(s), start, s)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        if best is not None:
            _, start, s = best
            self.stopped = True
            self.matched = s
            self._pending = ""
            return buf[:start], True
        hold = self._held_suffix_len(buf)
        self._pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """End of generation: release any held-back text (empty after a stop)."""
        out, self._pending = self._pending, ""
        return "" if self.stopped else out

    @property
    def pending(self) -> str:
        """Text currently held back (a possible start of a stop string)."""
        return self._pending
