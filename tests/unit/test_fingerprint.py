"""A service notices that its KV holds a different history than the call assumes.

Here the unit tests; the other tiers' are in tests/e2e/test_fingerprint.py.
"""

from __future__ import annotations

import random

from specdec.fingerprint import PrefixHashes, extend_hash, fingerprint


def test_prefix_hashes_extend_truncate_and_agree_with_one_shot():
    tokens = [random.Random(3).randrange(50_000) for _ in range(500)]
    hashes = PrefixHashes(tokens[:200])
    hashes.extend(tokens[200:])
    assert len(hashes) == 500
    for n in (0, 1, 37, 200, 500):
        assert hashes.at(n) == fingerprint(tokens[:n])
    hashes.truncate(100)
    hashes.extend([7, 8])
    assert hashes.at(102) == extend_hash(fingerprint(tokens[:100]), [7, 8]) == fingerprint(tokens[:100] + [7, 8])
    # order and value matter; 0 and the empty sequence are told apart
    assert fingerprint([1, 2]) != fingerprint([2, 1]) and fingerprint([0]) != fingerprint([])
