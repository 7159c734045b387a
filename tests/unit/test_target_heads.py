"""Medusa-style heads on the target (`serve target --heads`): a Verify that asks for them returns,
per head, the top tokens an independent computation gives — the HF model's final hidden state at
the position whose logits chose next_token, through the heads and the model's own output layer —
for γ = 0, a chain with a rejection, a fully accepted chain, a tree, and all of them batched
together; on the torch and the graph engines, in float64 and float32. Heads of another model and
the llama.cpp engine are refused at start; a target without heads returns none.

Here the unit tests; the other tiers' are in tests/service/test_target_heads.py.
"""

from __future__ import annotations

import pytest

from specdec.config import TargetConfig
from specdec.rpc.convert import model_info_from_pb, model_info_to_pb
from specdec.runtime.engines import engine_from_config
from specdec.runtime.heads import HeadsMismatch
from specdec.runtime.loader import load_model
from specdec.tokenizer import ModelLoadError
from specdec.types import ModelDescription
from tests.cluster import _free_port
from tests.service.test_target_heads import (
    NUM_HEADS,
    HISTORY,
    random_heads,
    heads_dirs,
    greedy,
    expected,
    wrong,
)


def test_model_info_carries_the_heads_both_ways():
    description = ModelDescription("m", 10, "f", 10, (0,), 64, "float32", "cpu", 8, num_heads=4, heads_id="ab" * 16)
    assert model_info_from_pb(model_info_to_pb(description)) == description


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


def test_llama_cpp_refuses_heads(heads_dirs):
    with pytest.raises(ModelLoadError, match="--heads needs the target's hidden states"):
        engine_from_config(TargetConfig(model="model.gguf", backend="llama.cpp", heads=heads_dirs["target"]))


@pytest.mark.parametrize("dtype, quantize", [("bfloat16", "none"), ("float32", "int8")])
def test_heads_load_on_packed_and_quantized_targets(models, heads_dirs, dtype, quantize):
    """The identity check reads the output layer before it is packed or quantized; the heads then
    share the layer as served (warm-up runs them once)."""
    engine = engine_from_config(TargetConfig(model=models["llama"]["target"], dtype=dtype, quantize=quantize,
                                             heads=heads_dirs["target"]))
    engine.warm_up()
    assert engine.description.num_heads == NUM_HEADS
    assert engine.heads.heads.blocks[0].weight.dtype == engine.loaded.dtype


def test_up_passes_the_target_heads_on():
    from specdec_cli import up
    from specdec_cli.main import build_parser

    addresses = {"draft": "127.0.0.1:6001", "target": "127.0.0.1:6002"}
    argvs = up.commands(build_parser().parse_args(["up", "--target-heads", "/h"]), "D", "T", addresses)
    assert argvs["target"][argvs["target"].index("--heads") + 1] == "/h" and "--heads" not in argvs["draft"]
    plain = up.commands(build_parser().parse_args(["up"]), "D", "T", addresses)
    assert "--heads" not in plain["target"]


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
