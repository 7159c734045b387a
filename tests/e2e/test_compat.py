"""Draft/target compatibility is decided on the ids both models can emit, and on their eos ids.

Here the e2e tests; the other tiers' are in tests/unit/test_compat.py and
tests/service/test_compat.py. The tier split shares one description: see tests/service/test_compat.py.
"""

from __future__ import annotations

import grpc
import pytest

from specdec_cli import tiny
from specdec.tokenizer import load_tokenizer, tokenizer_fingerprint
from specdec.v1 import target_pb2, target_pb2_grpc
from tests.cluster import Cluster
from tests.e2e.test_e2e_greedy import reference
from tests.service.test_compat import EOS, mixed_pair, _with_eos
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "Le café est très chaud"]
NEW_TOKENS = 24


def test_mixed_architectures_with_one_tokenizer_are_accepted_and_exact(mixed_pair):
    draft, target, _ = mixed_pair
    expected = reference(target, PROMPTS, NEW_TOKENS)
    with Cluster(draft, target) as cluster:
        for gamma in (1, 4):
            for prompt in PROMPTS:
                response = cluster.complete(prompt=prompt, max_new_tokens=NEW_TOKENS,
                                            num_speculative_tokens=gamma, ignore_eos=True)
                assert list(response.token_ids) == expected[prompt], (gamma, prompt)
                assert response.stats.draft_tokens > 0
        # the services fingerprint the ids below the size asked for; 0 is refused precisely
        with grpc.insecure_channel(f"127.0.0.1:{cluster.target_port}") as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            full = stub.GetModelInfo(target_pb2.TargetServiceGetModelInfoRequest(), timeout=10).info
            cut = stub.GetModelInfo(target_pb2.TargetServiceGetModelInfoRequest(fingerprint_vocab_size=100),
                                    timeout=10).info
            assert full.vocab_size == 384 and full.tokenizer_vocab_size == 385
            assert full.tokenizer_fingerprint == tokenizer_fingerprint(load_tokenizer(target), 384)
            assert cut.tokenizer_fingerprint == tokenizer_fingerprint(load_tokenizer(target), 100)
            with pytest.raises(grpc.RpcError) as info:
                stub.GetModelInfo(target_pb2.TargetServiceGetModelInfoRequest(fingerprint_vocab_size=0),
                                  timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "fingerprint_vocab_size" in info.value.details()


def test_a_draft_with_more_eos_ids_is_accepted_and_only_the_targets_end_generation(mixed_pair, tmp_path):
    """A draft that also ends on a token the target emits (as llama.cpp's end-of-generation set
    adds ids to a checkpoint's eos) is accepted, and that token ends nothing."""
    _, target, tokenizer = mixed_pair
    expected = reference(target, [PROMPTS[0]], NEW_TOKENS)[PROMPTS[0]]
    eos = tokenizer.convert_tokens_to_ids(EOS)
    stop = expected.index(eos) + 1 if eos in expected else NEW_TOKENS
    extra = expected[0]
    assert extra != eos and stop > 1
    draft = _with_eos(tiny.build_model(tmp_path / "more-eos", tokenizer, "gpt2", seed=35, layers=1),
                      [eos, extra])
    with Cluster(str(draft), target) as cluster:
        reply = cluster.complete(prompt=PROMPTS[0], max_new_tokens=NEW_TOKENS, num_speculative_tokens=3)
    assert list(reply.token_ids) == expected[:stop]
