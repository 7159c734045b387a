"""A cheap fingerprint of a token prefix: a polynomial rolling hash mod 2^61 − 1.

The coordinator sends, with every Propose / Verify, the fingerprint of the prefix it assumes
the service holds; the service keeps the same hashes for its cached tokens and answers a
cache miss when they differ (another coordinator drove the session, an old request was
replayed, ...). Both sides keep the hash of every prefix, so extending, cropping and looking
up a prefix length cost O(new tokens), O(1) and O(1).
"""

from __future__ import annotations

from array import array
from typing import Iterable

MOD = (1 << 61) - 1
BASE = 0x9E3779B97F4A7C15 % MOD


def extend_hash(value: int, tokens: Iterable[int]) -> int:
    """The fingerprint of prefix + tokens, given the fingerprint of prefix."""
    for token in tokens:
        value = (value * BASE + token + 1) % MOD
    return value


def fingerprint(tokens: Iterable[int]) -> int:
    """The fingerprint of a whole token sequence (0 for the empty one)."""
    return extend_hash(0, tokens)


class PrefixHashes:
    """The fingerprint of every prefix of a growing token sequence."""

    __slots__ = ("_hashes",)

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self._hashes = array("Q", [0])  # [i] = fingerprint of the first i tokens
        self.extend(tokens)

    def __len__(self) -> int:
        """Number of tokens covered."""
        return len(self._hashes) - 1

    def extend(self, tokens: Iterable[int]) -> None:
        value = self._hashes[-1]
        append = self._hashes.append
        for token in tokens:
            value = (value * BASE + token + 1) % MOD
            append(value)

    def at(self, length: int) -> int:
        """The fingerprint of the first `length` tokens."""
        return self._hashes[length]

    def truncate(self, length: int) -> None:
        del self._hashes[length + 1:]
