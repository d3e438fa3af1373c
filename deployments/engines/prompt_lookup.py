"""Prompt lookup: draft tokens for speculative decoding from a row's own tokens, no draft model.

An edit, a file rewrite or a quoted answer repeats text that the prompt (or the output so far)
already holds. The last `n` tokens of the row are looked up among its earlier tokens (n from
`ngram_max` down to `ngram_min`, the most recent earlier occurrence), and the tokens that followed
that occurrence are the proposal. Each n-gram is indexed once, as the row's tokens grow, so a
proposal costs a few dictionary lookups whatever the context's length. Pure Python: no MLX, no
memory on the device.

Only the last `window` tokens of the row at its first proposal are indexed (16384 unless set), and
every token after them: the index costs about 340 bytes of host memory a token (three n-gram sizes,
a tuple key each), and its first build runs on the engine's MLX thread, so a 64k-token prompt
indexed whole would cost ~21 MiB a row and ~0.4 s before the row's first verify step. What is
repeated is mostly recent (the file being edited, the last turns); a repeat further back than the
window is not proposed."""

from collections.abc import Sequence

WINDOW = 16384


class PromptLookup:
    """Proposals for one row. `propose` takes the row's whole token sequence each time; a later
    sequence must extend the earlier ones (a row's context only grows)."""

    def __init__(self, ngram_max: int = 4, ngram_min: int = 2, window: int = WINDOW):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"n-gram sizes must satisfy 1 <= ngram_min <= ngram_max, not {ngram_min}, {ngram_max}")
        if window < 1:
            raise ValueError(f"the lookup window must be at least one token, not {window}")
        self.sizes = tuple(range(ngram_max, ngram_min - 1, -1))  # longest first
        self.window = window
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}  # n-gram -> where the token after it is
        self._indexed = 0  # n-grams ending before this position are indexed (or left out: older than the window)

    def propose(self, tokens: Sequence[int], k: int, then: Sequence[int] = ()) -> list[int]:
        """Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix
        of the row's sequence found (none: []). The sequence is `tokens` followed by `then` (the
        token the row feeds next, passed apart so that the row's list is never copied)."""
        first, end = len(tokens), len(tokens) + len(then)

        def part(a: int, b: int) -> list[int]:  # the sequence's [a, b)
            return [*tokens[a : min(b, first)], *then[max(0, a - first) : max(0, b - first)]]

        # index the n-grams that end before the suffix being looked up (never the suffix itself)
        start = max(self._indexed, end - self.window, 1)
        if start < end:
            lo = max(0, start - self.sizes[0])
            recent = part(lo, end)
            for stop in range(start, end):
                for n in self.sizes:
                    if stop >= n:
                        self._index[n][tuple(recent[stop - n - lo : stop - lo])] = stop
        self._indexed = max(self._indexed, end)
        if k <= 0:
            return []
        for n in self.sizes:
            if end < n:
                continue
            at = self._index[n].get(tuple(part(end - n, end)))
            if at is not None:
                return part(at, min(at + k, end))
        return []
