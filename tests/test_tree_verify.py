"""A token tree verified in one target forward (engine, verifier, Verify over gRPC): each node's
logits are those of its own path run alone, only the accepted path's K/V stay, and greedy
output is the target's own (float64)."""

from __future__ import annotations

import grpc
import pytest
import torch

from specdec.fingerprint import fingerprint
from specdec.runtime.kv_cache import SessionCaches
from specdec.runtime.loader import load_model
from specdec.runtime.torch.engine import TorchEngine
from specdec.runtime.session_kv import Row
from specdec.maths.tree import TokenTree
from specdec.types import SamplingParams
from specdec.runtime.verification import HostVerification

HISTORY = [5, 17, 42, 9, 33, 8, 21, 64, 3, 77]
#        root (77)
#       /    \
#     n0(11) n1(12)
#     /  \      \
#  n2(13) n3(14) n4(15)
#    |
#  n5(16)
TREE = TokenTree((11, 12, 13, 14, 15, 16), (0, 0, 1, 1, 2, 3))


@pytest.fixture(params=["llama", "gpt2"])
def engine(request, models):
    return TorchEngine(load_model(models[request.param]["target"], "float64"), SessionCaches(16, 1 << 30), 16)


def alone(engine, tokens: list[int]) -> torch.Tensor:
    """The logits after `tokens`, run from scratch in a session of their own -> [vocab]."""
    entry = engine.new_entry()
    return engine.forward("", entry, tokens, 1)[0]


def prefill(engine, sid: str, tokens: list[int]):
    entry, feed = engine.begin(sid, 0, 0, tokens)
    engine.forward(sid, entry, feed[:-1], 1)
    return entry


@pytest.mark.unit
def test_each_node_gets_the_logits_of_its_own_path(engine):
    assert engine.verifies_trees and engine.description.verifies_trees
    entry = prefill(engine, "t", HISTORY)
    # a batch of two sessions: the tree, and a plain chain of another length beside it
    other = prefill(engine, "c", HISTORY[:6])
    rows = [Row("t", entry, [HISTORY[-1], *TREE.tokens], len(TREE) + 1, TREE),
            Row("c", other, [HISTORY[5], 40, 41], 3)]
    tree_logits, chain_logits = engine.forward_batch(rows)  # [1 + n, vocab], [3, vocab]
    torch.testing.assert_close(tree_logits[0], alone(engine, HISTORY))
    for node in range(len(TREE)):
        path = [TREE.tokens[i] for i in TREE.path(node)]
        torch.testing.assert_close(tree_logits[node + 1], alone(engine, HISTORY + path), msg=f"node {node}")
    torch.testing.assert_close(chain_logits[-1], alone(engine, HISTORY[:6] + [40, 41]))
    # one session alone (no batch): the tree still gets its mask
    single = prefill(engine, "s", HISTORY)
    [logits] = engine.forward_batch([Row("s", single, [HISTORY[-1], *TREE.tokens], len(TREE) + 1, TREE)])
    torch.testing.assert_close(logits, tree_logits)


@pytest.mark.unit
def test_only_the_accepted_path_stays(engine):
    entry = prefill(engine, "t", HISTORY)
    engine.forward_batch([Row("t", entry, [HISTORY[-1], *TREE.tokens], len(TREE) + 1, TREE)])
    base = len(HISTORY)
    path = TREE.path(5)  # nodes 0, 2, 5: tokens 11, 13, 16
    engine.keep_path(entry, base, path)
    kept = HISTORY + [11, 13, 16]
    assert list(entry.tokens) == kept and entry.hashes.at(len(kept)) == fingerprint(kept)
    fresh = engine.new_entry()
    engine.forward("", fresh, kept, 1)
    torch.testing.assert_close(entry.kv.data[:, :, :, :len(kept)], fresh.kv.data[:, :, :, :len(kept)])
    # and the session goes on from there as if the path had been run alone
    torch.testing.assert_close(engine.forward("t", entry, [7], 1)[0], alone(engine, kept + [7]))


def greedy_tree(engine, history: list[int], width: int, depth: int) -> TokenTree:
    """A tree of the target's own `width` most likely tokens at each depth under the first
    child (so the greedy path runs through it), plus a wrong sibling branch."""
    tokens, parents, parent, context = [], [], 0, list(history)
    for _ in range(depth):
        top = torch.topk(alone(engine, context), width).indices.tolist()
        for token in reversed(top):  # the argmax last among its siblings
            tokens.append(token)
            parents.append(parent)
        parent = len(tokens)  # the argmax (the last added) is the next parent
        context.append(top[0])
    return TokenTree(tuple(tokens), tuple(parents))


@pytest.mark.unit
def test_greedy_verification_of_a_tree_is_the_target_alone(engine):
    verifier = HostVerification(engine)
    tree = greedy_tree(engine, HISTORY, width=3, depth=3)
    call = verifier.call("g", 0, 0, HISTORY, list(tree.tokens), [], SamplingParams(0.0), 0,
                         draft_parents=list(tree.parents))
    [verdict] = verifier.verify_batch([call])
    expected, context = [], list(HISTORY)
    for _ in range(4):  # three accepted nodes and the bonus token
        expected.append(int(alone(engine, context).argmax()))
        context.append(expected[-1])
    assert verdict.num_accepted == 3 and verdict.is_bonus
    assert verdict.committed(list(tree.tokens)) == expected
    assert verdict.cached_len == len(HISTORY) + 3
    assert list(engine.caches.get("g").tokens) == HISTORY + expected[:3]
    # a tree whose first depth misses the argmax: nothing accepted, the argmax recovered
    wrong = TokenTree((1, 2), (0, 0)) if expected[0] not in (1, 2) else TokenTree((3, 4), (0, 0))
    call = verifier.call("w", 0, 0, HISTORY, list(wrong.tokens), [], SamplingParams(0.0), 0,
                         draft_parents=list(wrong.parents))
    [verdict] = verifier.verify_batch([call])
    assert verdict.num_accepted == 0 and verdict.next_token == expected[0] and not verdict.is_bonus
    assert list(engine.caches.get("w").tokens) == HISTORY


@pytest.mark.unit
def test_a_tree_is_refused_where_it_cannot_be_verified(engine):
    verifier = HostVerification(engine)
    with pytest.raises(Exception, match=r"draft_parents\[1\] is 2"):
        verifier.call("x", 0, 0, HISTORY, [1, 2], [], SamplingParams(0.0), 0, draft_parents=[0, 2])
    chain = verifier.call("x", 0, 0, HISTORY, [1, 2], [], SamplingParams(0.0), 0, draft_parents=[0, 1])
    assert chain.tree is None  # a chain's parents: verified as a chain
    engine.kv_spec = None  # an engine that cannot mask a tree
    with pytest.raises(Exception, match="verifies chains only"):
        verifier.call("x", 0, 0, HISTORY, [1, 2], [], SamplingParams(0.0), 0, draft_parents=[0, 0])


@pytest.mark.service
def test_verify_over_grpc_takes_a_tree(models):
    from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
    from tests.cluster import Cluster

    with Cluster(models["llama"]["draft"], models["llama"]["target"]) as cluster, \
            grpc.insecure_channel(f"127.0.0.1:{cluster.target_port}") as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        info = stub.GetModelInfo(target_pb2.TargetServiceGetModelInfoRequest()).info
        assert info.verifies_trees
        greedy = common_pb2.SamplingParams(temperature=0.0)
        first = stub.Verify(target_pb2.VerifyRequest(session_id="v", new_tokens=HISTORY, sampling=greedy))
        history, argmax = HISTORY + [first.next_token], None
        # the next argmax, from a plain step on a second session with the same history
        probe = stub.Verify(target_pb2.VerifyRequest(session_id="p", new_tokens=history, sampling=greedy))
        argmax = probe.next_token
        wrong = (argmax + 1) % info.vocab_size
        # two children of the root, the argmax second: it is accepted, reported as node 1
        reply = stub.Verify(target_pb2.VerifyRequest(
            session_id="v", prefix_len=len(HISTORY), prefix_hash=fingerprint(HISTORY),
            new_tokens=[first.next_token], draft_tokens=[wrong, argmax], draft_parents=[0, 0], sampling=greedy))
        assert reply.num_accepted == 1 and list(reply.accepted_nodes) == [1] and reply.is_bonus
        assert reply.cached_len == len(history) + 1
        # the session holds the accepted path: a plain step after it needs no resend
        after = history + [argmax]
        step = stub.Verify(target_pb2.VerifyRequest(
            session_id="v", prefix_len=len(after), prefix_hash=fingerprint(after), new_tokens=[reply.next_token],
            sampling=greedy))
        assert step.cached_len == len(after) + 1
        with pytest.raises(grpc.RpcError) as err:
            stub.Verify(target_pb2.VerifyRequest(session_id="bad", new_tokens=HISTORY, draft_tokens=[1, 2],
                                                 draft_parents=[1, 0], sampling=greedy))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "draft_parents[0] is 1" in err.value.details()


@pytest.mark.unit
def test_a_tree_grown_depth_by_depth_sees_only_its_ancestors(engine):
    """The draft's way: one forward per depth, the earlier depths already in the cache."""
    entry = prefill(engine, "d", HISTORY)
    engine.forward_batch([Row("d", entry, [HISTORY[-1], *TREE.tokens[:2]], 3, TokenTree(TREE.tokens[:2],
                                                                                       TREE.parents[:2]))])
    depth2 = TokenTree(TREE.tokens[:5], TREE.parents[:5])
    [logits] = engine.forward_batch([Row("d", entry, list(TREE.tokens[2:5]), 3, depth2)])  # nodes 2, 3, 4
    for k, node in enumerate((2, 3, 4)):
        path = [TREE.tokens[i] for i in TREE.path(node)]
        torch.testing.assert_close(logits[k], alone(engine, HISTORY + path), msg=f"node {node}")
    [logits] = engine.forward_batch([Row("d", entry, [TREE.tokens[5]], 1, TREE)])
    torch.testing.assert_close(logits[0], alone(engine, HISTORY + [11, 13, 16]))  # node 5, under node 2


@pytest.mark.unit
def test_a_trees_logprobs_are_those_of_its_accepted_path(engine):
    verifier = HostVerification(engine)
    tree = greedy_tree(engine, HISTORY, width=2, depth=2)
    call = verifier.call("l", 0, 0, HISTORY, list(tree.tokens), [], SamplingParams(0.0), 0, top_logprobs=2,
                         draft_parents=list(tree.parents))
    [verdict] = verifier.verify_batch([call])
    emitted = verdict.committed(list(tree.tokens))
    assert [entry.token_id for entry in verdict.logprobs] == emitted and len(emitted) == 3
    for k, entry in enumerate(verdict.logprobs):
        expected = torch.log_softmax(alone(engine, HISTORY + emitted[:k]), dim=-1)  # [vocab]
        assert entry.logprob == pytest.approx(expected[entry.token_id].item(), abs=1e-9)
        assert [t for t, _ in entry.top] == torch.topk(expected, 2).indices.tolist()
