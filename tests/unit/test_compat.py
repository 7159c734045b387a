"""Draft/target compatibility is decided on the ids both models can emit, and on their eos ids.

Here the unit tests; the other tiers' are in tests/service/test_compat.py and
tests/e2e/test_compat.py. The tier split shares one description: see tests/service/test_compat.py.
"""

from __future__ import annotations

from specdec.tokenizer import fingerprints, load_tokenizer, tokenizer_fingerprint
from tests.service.test_compat import mixed_pair


def test_the_mismatch_is_real(mixed_pair):
    """Same files, different tokenizer classes: the full vocabularies differ by one entry."""
    draft, target, tokenizer = mixed_pair
    draft_tok, target_tok = load_tokenizer(draft), load_tokenizer(target)
    assert len(tokenizer) == 384
    assert len(draft_tok) == 384 and len(target_tok) == 385
    assert target_tok.convert_tokens_to_ids("<|endoftext|>") == 384
    assert tokenizer_fingerprint(draft_tok) != tokenizer_fingerprint(target_tok)
    assert tokenizer_fingerprint(draft_tok, 384) == tokenizer_fingerprint(target_tok, 384)


def test_a_service_computes_each_fingerprint_once(mixed_pair):
    """A probe that timed out while the fingerprint was computed finds it at hand next time."""
    target_tok = load_tokenizer(mixed_pair[1])
    reads = []
    vocab = target_tok.get_vocab
    target_tok.get_vocab = lambda: reads.append(1) or vocab()
    fingerprint = fingerprints(target_tok)
    assert fingerprint(384) == fingerprint(384) == tokenizer_fingerprint(load_tokenizer(mixed_pair[1]), 384)
    assert fingerprint(None) != fingerprint(384) and fingerprint(None) == fingerprint(None)
    assert len(reads) == 2  # one per limit
