"""Tiny Llama / Qwen2 / Mistral models in memory (fixed seeds) and HF reference logits, for the
graph engine's tests."""

from __future__ import annotations

from typing import Sequence

import torch

from specdec_cli import tiny
from specdec.runtime.graph.batch import RowInput
from specdec.runtime.graph.cuda_graphs import Buckets, CudaGraphRunner
from specdec.runtime.graph.model import GraphModel
from specdec.runtime.graph.paged_kv import PagedKV

VOCAB = 96
ARCHS = ("llama", "qwen2", "llama3-tied", "mistral")


def hf_model(arch: str, dtype: torch.dtype = torch.float64, seed: int = 5, layers: int = 2):
    """A random transformers causal LM of `arch` (eval mode, CPU, no EOS so generate never stops)."""
    from transformers import AutoModelForCausalLM, MistralConfig

    if arch == "mistral":
        config = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                               num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512,
                               sliding_window=256, tie_word_embeddings=False)
    else:
        config = tiny.model_config("qwen2" if arch == "qwen2" else "llama", VOCAB, 0, layers=layers)
    if arch == "llama3-tied":  # tied embeddings, a non-default rope type and theta
        config.tie_word_embeddings = True
        config.rope_parameters = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 64}
    config.initializer_range = 0.5
    config.eos_token_id = None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@torch.inference_mode()
def reference(model, tokens: Sequence[int]) -> torch.Tensor:
    """HF logits of every position of one sequence, no cache -> [len, vocab]."""
    return model(torch.tensor([list(tokens)], device=model.device)).logits[0]


def runner_for(model, block_size: int = 4, blocks: int = 128, buckets: Buckets | None = None) -> CudaGraphRunner:
    graph = GraphModel.from_hf(model)
    return CudaGraphRunner(graph, PagedKV(graph.pool_spec(block_size), blocks), buckets)


def sequence(n: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (n,), generator=generator).tolist()


def run(runner: CudaGraphRunner, session_id: str, tokens: Sequence[int], keep: int | None = None) -> torch.Tensor:
    """One row's forward (a new session when unknown) -> [keep, vocab] (all tokens by default)."""
    if session_id not in runner.kv:
        runner.kv.new_session(session_id)
    return runner.forward([RowInput(session_id, list(tokens), keep or len(tokens))])[0]
