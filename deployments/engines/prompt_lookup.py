"""Prompt lookup: draft tokens for speculative decoding from a row's own tokens, no draft model.

An edit, a file rewrite or a quoted answer repeats text that the prompt (or the output so far)
already holds. The last `n` tokens of the row are looked up among its earlier tokens (n from
`ngram_max` down to `ngram_min`, the most recent earlier occurrence), and the tokens that followed
that occurrence are the proposal. Each n-gram is indexed once, as the row's tokens grow, so a
proposal costs a few dictionary lookups whatever the context's length. Pure Python: no MLX, no
memory on the device."""

from collections.abc import Sequence


class PromptLookup:
    """Proposals for one row. `propose` takes the row's whole token sequence each time; a later
    sequence must extend the earlier ones (a row's context only grows)."""

    def __init__(self, ngram_max: int = 4, ngram_min: int = 2):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"n-gram sizes must satisfy 1 <= ngram_min <= ngram_max, not {ngram_min}, {ngram_max}")
        self.sizes = tuple(range(ngram_max, ngram_min - 1, -1))  # longest first
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}  # n-gram -> where the token after it is
        self._indexed = 0  # n-grams ending before this position are indexed

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix
        of `tokens` found (none: [])."""
        end = len(tokens)
        # index the n-grams that end before the suffix being looked up (never the suffix itself)
        for stop in range(max(self._indexed, 1), end):
            for n in self.sizes:
                if stop >= n:
                    self._index[n][tuple(tokens[stop - n : stop])] = stop
        self._indexed = max(self._indexed, end)
        if k <= 0:
            return []
        for n in self.sizes:
            if end < n:
                continue
            at = self._index[n].get(tuple(tokens[end - n :]))
            if at is not None:
                return list(tokens[at : at + k])
        return []
