"""Prompt-lookup (n-gram) drafting: propose the tokens that followed the last occurrence of the
sequence's current suffix earlier in the same sequence. Free to compute, and strong on inputs that
repeat themselves (code edits, quoting, summaries, extraction)."""

from __future__ import annotations

from collections.abc import Sequence


class NgramDrafter:
    """Proposes up to ``k`` draft tokens by matching the longest suffix of length max_n .. min_n."""

    def __init__(self, k: int, max_n: int = 4, min_n: int = 1):
        for name, value in (("k", k), ("max_n", max_n), ("min_n", min_n)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if min_n > max_n:
            raise ValueError(f"min_n: {min_n} exceeds max_n={max_n}")
        self.k = k
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, tokens: Sequence[int]) -> list[int]:
        """Draft tokens continuing ``tokens`` (possibly fewer than k, or none)."""
        length = len(tokens)
        if length <= self.min_n:
            return []  # no earlier occurrence of even the shortest suffix fits
        last = tokens[-1]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = list(tokens[length - n:])
            # Latest earlier occurrence first: recent context predicts best. A candidate must end in the
            # last token; checking that one token first skips building a slice at almost every position.
            for start in range(length - n - 1, -1, -1):
                if tokens[start + n - 1] == last and list(tokens[start: start + n]) == suffix:
                    follow = list(tokens[start + n: start + n + self.k])
                    if follow:
                        return follow
        return []
