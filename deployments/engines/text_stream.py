"""Stop strings on a text stream: emit text as soon as it cannot be the start of a stop string,
hold back only the tail that still might be, and cut exactly at the first stop string found.
Pure Python, so it is tested on its own."""


class StopStringFilter:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best

    def push(self, segment: str) -> str:
        """Feed new text; returns the text that is safe to emit now. Sets `stopped` on a match."""
        if self.stopped:
            return ""
        text = self._held + segment
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held, self.stopped = "", True
            return text[:cut]
        keep = self._holdback(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The stream ended without a stop string: the held-back tail is ordinary text."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
