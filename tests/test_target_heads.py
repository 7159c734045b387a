"""Medusa-style heads on the target (`serve target --heads`): a Verify that asks for them returns,
per head, the top tokens an independent computation gives — the HF model's final hidden state at
the position whose logits chose next_token, through the heads and the model's own output layer —
for γ = 0, a chain with a rejection, a fully accepted chain, a tree, and all of them batched
together; on the torch and the graph engines, in float64 and float32. Heads of another model and
the llama.cpp engine are refused at start; a target without heads returns none."""

from __future__ import annotations

import grpc
import pytest
import torch

from specdec.config import TargetConfig
from specdec.rpc.convert import model_info_from_pb, model_info_to_pb
from specdec.runtime.engines import engine_from_config
from specdec.runtime.heads import HeadsMeta, HeadsMismatch, MedusaHeads, save_heads, target_identity
from specdec.runtime.loader import load_model
from specdec.tokenizer import ModelLoadError
from specdec.types import ModelDescription
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service import server as target_server
from tests.cluster import _free_port
from tests.spies import held_worker

NUM_HEADS = 3
HISTORY = [5, 17, 42, 9, 33, 8, 21, 64, 3, 77]
GREEDY = common_pb2.SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
ENGINES = [("torch", "float64"), ("graph", "float64"), ("torch", "float32"), ("graph", "float32")]


def random_heads(hidden_size: int, seed: int, num_heads: int = NUM_HEADS, scale: float = 0.5) -> MedusaHeads:
    """Heads with non-zero blocks (a fixed seed, weights of standard deviation `scale`): their
    tokens are not the target's own top ones."""
    torch.manual_seed(seed)
    heads = MedusaHeads(num_heads, hidden_size)
    with torch.no_grad():
        for block in heads.blocks:
            block.weight.normal_(0, scale)
            block.bias.normal_(0, scale)
    return heads.eval()


@pytest.fixture(scope="module")
def heads_dirs(models, tmp_path_factory):
    """Heads for the llama target, and heads for its draft (another model of the same width)."""
    root = tmp_path_factory.mktemp("heads")
    dirs = {}
    for name in ("target", "draft"):
        hf = load_model(models["llama"][name], "float32").model
        meta = HeadsMeta(NUM_HEADS, hf.config.hidden_size, target_identity(hf), models["llama"][name])
        dirs[name] = str(save_heads(root / name, random_heads(hf.config.hidden_size, seed=7), meta))
    return dirs


@pytest.fixture(scope="module", params=ENGINES, ids=[f"{e}-{d}" for e, d in ENGINES])
def served(request, models, heads_dirs):
    """A target service with heads, its stub, servicer, the HF model and the heads (its dtype)."""
    engine, dtype = request.param
    config = TargetConfig(model=models["llama"]["target"], dtype=dtype, backend=engine, kv_cache_bytes=8 << 20,
                          port=_free_port(), heads=heads_dirs["target"], batch_wait_ms=5.0)
    server, port, servicer = target_server.start(config)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    hf = load_model(models["llama"]["target"], dtype).model
    heads = random_heads(hf.config.hidden_size, seed=7).to(hf.dtype)
    yield target_pb2_grpc.TargetServiceStub(channel), servicer, hf, heads
    channel.close()
    server.stop(None).wait()


@torch.inference_mode()
def greedy(hf, tokens: list[int], n: int) -> list[int]:
    """The HF model's next n greedy tokens after `tokens`, one full forward each."""
    out = list(tokens)
    for _ in range(n):
        out.append(int(hf(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(tokens):]


@torch.inference_mode()
def expected(hf, heads: MedusaHeads, tokens: list[int], n: int) -> list[tuple[list[int], list[float]]]:
    """Per head, its n most likely tokens and their probabilities, read at the last position of
    `tokens` — computed apart from the services: the HF model's final hidden state, the heads,
    the model's output layer."""
    out = hf(torch.tensor([tokens]), output_hidden_states=True)
    hidden = out.hidden_states[-1][0, -1]  # [hidden]
    torch.testing.assert_close(hf.lm_head(hidden), out.logits[0, -1])  # what the output layer takes
    probs = torch.softmax(hf.lm_head(heads(hidden[None]))[:, 0].float(), dim=-1)  # [heads, vocab]
    top = torch.topk(probs, n, dim=-1)
    return list(zip(top.indices.tolist(), top.values.tolist()))


def wrong(token: int) -> int:
    """A token that is not `token` (a draft the greedy target rejects)."""
    return token + 1 if token < 300 else token - 1


def scenarios(hf) -> list[tuple[target_pb2.VerifyRequest, list[int]]]:
    """(a Verify asking for heads, the tokens up to the position whose logits choose its next
    token): γ = 0, a chain rejected at its second draft, a chain accepted in full, a tree whose
    path leaves the first child of the root."""
    g1, g2, g3 = greedy(hf, HISTORY, 3)
    # root ─ n0 (wrong), n1 (g1); n1 ─ n2 (g2), n3 (wrong); n2 ─ n4 (wrong): path n1, n2
    tree = ([wrong(g1), g1, g2, wrong(g2), wrong(g3)], [0, 0, 2, 2, 3])
    cases = [([], [], HISTORY, 4),
             ([g1, wrong(g2), g3], [], HISTORY + [g1], 1),
             ([g1, g2, g3], [], HISTORY + [g1, g2, g3], 8),
             (tree[0], tree[1], HISTORY + [g1, g2], 4)]
    return [(target_pb2.VerifyRequest(session_id=f"s{i}", prefix_len=0, new_tokens=HISTORY, draft_tokens=drafts,
                                      draft_parents=parents, sampling=GREEDY, head_candidates=n), path)
            for i, (drafts, parents, path, n) in enumerate(cases)]


def assert_proposals(got: target_pb2.VerifyResponse, want: list[tuple[list[int], list[float]]], what: str) -> None:
    assert len(got.head_proposals) == NUM_HEADS, what
    for k, (dist, (ids, probs)) in enumerate(zip(got.head_proposals, want)):
        assert list(dist.token_ids) == ids, f"{what}, head {k + 1}"
        assert list(dist.probs) == pytest.approx(probs, abs=1e-5), f"{what}, head {k + 1}"


@pytest.mark.service
def test_verify_returns_the_heads_proposals_alone_and_batched(served):
    stub, servicer, hf, heads = served
    cases = scenarios(hf)
    wants = [expected(hf, heads, path, request.head_candidates) for request, path in cases]
    alone = []
    for (request, path), want in zip(cases, wants):
        response = stub.Verify(request, timeout=60)
        assert response.num_accepted == len(path) - len(HISTORY), request.session_id
        assert_proposals(response, want, request.session_id)
        alone.append(response)
    assert alone[2].is_bonus and list(alone[3].accepted_nodes) == [1, 2]
    # the heads propose other tokens than the target's own next ones, and differ by position
    assert [ids[0] for ids, _ in wants[0]] != greedy(hf, HISTORY, NUM_HEADS + 1)[1:]
    assert len({tuple(tuple(ids) for ids, _ in want) for want in wants}) == len(wants)
    # all of them, and a call asking for none, in ONE batch: the same answers
    requests = [target_pb2.VerifyRequest(session_id=f"b-{r.session_id}", prefix_len=0, new_tokens=r.new_tokens,
                                         draft_tokens=r.draft_tokens, draft_parents=r.draft_parents,
                                         sampling=r.sampling, head_candidates=r.head_candidates)
                for r, _ in cases]
    requests.append(target_pb2.VerifyRequest(session_id="b-none", prefix_len=0, new_tokens=HISTORY, sampling=GREEDY))
    before = servicer.scheduler.batch_sizes.copy()
    with held_worker(servicer, queued=len(requests)):
        futures = [stub.Verify.future(request, timeout=60) for request in requests]
    batched = [future.result() for future in futures]
    assert servicer.scheduler.batch_sizes - before == {len(requests): 1}, "not one batch"
    for response, single, want, (request, _) in zip(batched, alone, wants, cases):
        assert_proposals(response, want, f"{request.session_id} batched")
        if hf.dtype == torch.float64:  # float32 rounds a batched forward otherwise, in the last bits
            assert response == single
        del response.head_proposals[:], single.head_proposals[:]
        assert response == single
    assert not batched[-1].head_proposals and batched[-1].next_token == alone[0].next_token


@pytest.mark.service
def test_model_info_reports_the_heads(served, heads_dirs):
    stub, servicer, _, _ = served
    info = stub.GetModelInfo(target_pb2.TargetServiceGetModelInfoRequest(), timeout=10).info
    assert info.num_heads == NUM_HEADS and len(info.heads_id) == 32
    assert info.heads_id == servicer.engine.heads.heads_id
    assert model_info_from_pb(info) == servicer.description  # both ways


@pytest.mark.service
@pytest.mark.parametrize("candidates", [-1, 33])
def test_head_candidates_out_of_range_is_invalid(served, candidates):
    stub = served[0]
    with pytest.raises(grpc.RpcError) as error:
        stub.Verify(target_pb2.VerifyRequest(session_id="bad", prefix_len=0, new_tokens=[1, 2], sampling=GREEDY,
                                             head_candidates=candidates), timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "head_candidates must be in 0..32" in error.value.details()


@pytest.mark.service
def test_a_target_without_heads_proposes_none(models):
    config = TargetConfig(model=models["llama"]["target"], dtype="float64", port=_free_port())
    server, port, servicer = target_server.start(config)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            info = stub.GetModelInfo(target_pb2.TargetServiceGetModelInfoRequest(), timeout=10).info
            assert info.num_heads == 0 and info.heads_id == ""
            response = stub.Verify(target_pb2.VerifyRequest(session_id="n", prefix_len=0, new_tokens=HISTORY,
                                                            sampling=GREEDY, head_candidates=4), timeout=30)
            assert not response.head_proposals and response.next_token > 0
            with pytest.raises(grpc.RpcError) as error:
                stub.Verify(target_pb2.VerifyRequest(session_id="n", prefix_len=0, new_tokens=HISTORY,
                                                     sampling=GREEDY, head_candidates=33), timeout=30)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        server.stop(None).wait()


@pytest.mark.unit
def test_model_info_carries_the_heads_both_ways():
    description = ModelDescription("m", 10, "f", 10, (0,), 64, "float32", "cpu", 8, num_heads=4, heads_id="ab" * 16)
    assert model_info_from_pb(model_info_to_pb(description)) == description


@pytest.mark.unit
def test_heads_of_another_model_are_refused_at_start(models, heads_dirs):
    from specdec_cli.main import main

    for backend in ("torch", "graph"):
        with pytest.raises(HeadsMismatch, match="were trained for another model"):
            engine_from_config(TargetConfig(model=models["llama"]["target"], dtype="float32", backend=backend,
                                            kv_cache_bytes=8 << 20, heads=heads_dirs["draft"]))
    with pytest.raises(SystemExit) as exit_:  # the command: one line, no traceback
        main(["serve", "target", "--model", models["llama"]["target"], "--dtype", "float32",
              "--port", str(_free_port()), "--heads", heads_dirs["draft"]])
    message = str(exit_.value.code)
    assert message.startswith("specdec serve target: the heads in ") and "\n" not in message
    assert "specdec distill --heads K" in message


@pytest.mark.unit
def test_llama_cpp_refuses_heads(heads_dirs):
    with pytest.raises(ModelLoadError, match="--heads needs the target's hidden states"):
        engine_from_config(TargetConfig(model="model.gguf", backend="llama.cpp", heads=heads_dirs["target"]))


@pytest.mark.unit
@pytest.mark.parametrize("dtype, quantize", [("bfloat16", "none"), ("float32", "int8")])
def test_heads_load_on_packed_and_quantized_targets(models, heads_dirs, dtype, quantize):
    """The identity check reads the output layer before it is packed or quantized; the heads then
    share the layer as served (warm-up runs them once)."""
    engine = engine_from_config(TargetConfig(model=models["llama"]["target"], dtype=dtype, quantize=quantize,
                                             heads=heads_dirs["target"]))
    engine.warm_up()
    assert engine.description.num_heads == NUM_HEADS
    assert engine.heads.heads.blocks[0].weight.dtype == engine.loaded.dtype


@pytest.mark.unit
def test_up_passes_the_target_heads_on():
    from specdec_cli import up
    from specdec_cli.main import build_parser

    addresses = {"draft": "127.0.0.1:6001", "target": "127.0.0.1:6002"}
    argvs = up.commands(build_parser().parse_args(["up", "--target-heads", "/h"]), "D", "T", addresses)
    assert argvs["target"][argvs["target"].index("--heads") + 1] == "/h" and "--heads" not in argvs["draft"]
    plain = up.commands(build_parser().parse_args(["up"]), "D", "T", addresses)
    assert "--heads" not in plain["target"]


@pytest.mark.unit
def test_the_dynamic_cache_path_hands_out_hidden_states_too(models, heads_dirs):
    """A model whose K/V cannot live in buffers runs its rows one by one: each row's hidden states
    still come from its own forward."""
    from specdec.types import SamplingParams

    engine = engine_from_config(TargetConfig(model=models["llama"]["target"], dtype="float64",
                                             heads=heads_dirs["target"]))
    engine.kv_spec = None  # as a model that keeps a DynamicCache per session
    hf = load_model(models["llama"]["target"], "float64").model
    heads = random_heads(hf.config.hidden_size, seed=7).double()
    g1, g2 = greedy(hf, HISTORY, 2)
    verification = engine.verification()
    calls = [verification.call("d0", 0, 0, HISTORY, [g1, wrong(g2)], [], SamplingParams(0.0), 0, head_candidates=3),
             verification.call("d1", 0, 0, HISTORY[:6], [], [], SamplingParams(0.0), 0, head_candidates=2)]
    first, second = verification.verify_batch(calls)
    for verdict, path, n in ((first, HISTORY + [g1], 3), (second, HISTORY[:6], 2)):
        want = expected(hf, heads, path, n)
        assert [list(d.token_ids) for d in verdict.head_proposals] == [ids for ids, _ in want]
        assert [list(d.probs) for d in verdict.head_proposals] == [pytest.approx(p, abs=1e-6) for _, p in want]
