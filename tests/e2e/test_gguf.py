"""A .gguf file loads through transformers' GGUF loader and serves exactly like its checkpoint."""

from __future__ import annotations

import torch

from specdec.runtime.loader import load_model
from specdec.tokenizer import tokenizer_fingerprint
from tests.cluster import Cluster
from tests.gguf_writer import write_llama_gguf
from tests.e2e.test_e2e_greedy import reference


def test_gguf_file_matches_its_checkpoint(models, tmp_path):
    source = models["llama"]["target"]
    gguf_path = write_llama_gguf(source, tmp_path / "tiny-llama-f32.gguf")
    from_gguf, from_dir = load_model(str(gguf_path), "float64"), load_model(source, "float64")
    ids = from_dir.tokenizer("def fibonacci(n): héllo 🚀")["input_ids"]
    assert from_gguf.tokenizer("def fibonacci(n): héllo 🚀")["input_ids"] == ids
    with torch.inference_mode():
        a = from_gguf.model(torch.tensor([ids])).logits
        b = from_dir.model(torch.tensor([ids])).logits
    assert torch.allclose(a, b, atol=1e-6)
    assert tokenizer_fingerprint(from_gguf.tokenizer) == tokenizer_fingerprint(from_dir.tokenizer)

    expected = reference(source, ["def fibonacci(n):"], 24)
    with Cluster(models["llama"]["draft"], str(gguf_path), target={"backend": "torch"}) as cluster:
        response = cluster.complete(prompt="def fibonacci(n):", max_new_tokens=24, num_speculative_tokens=3,
                                    ignore_eos=True)
    assert list(response.token_ids) == expected["def fibonacci(n):"]
