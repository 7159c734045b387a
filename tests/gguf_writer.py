"""Write a tiny Llama checkpoint as a GGUF file (F32 tensors, GPT-2 style BPE tokenizer), the way
llama.cpp's converter lays it out, so the GGUF loading path can be tested offline."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def _permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rotary permutation of q/k rows (transformers reverses it on load)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_llama_gguf(model_dir: str | Path, out: str | Path, eot_token_id: int | None = None) -> Path:
    """eot_token_id: an end-of-turn id, which llama.cpp adds to the ids that end generation (as a
    real chat model's GGUF does), beside the checkpoint's eos."""
    import gguf
    from safetensors.numpy import load_file

    model_dir, out = Path(model_dir), Path(out)
    config = json.loads((model_dir / "config.json").read_text())
    state = {k: v.astype(np.float32) for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    writer.add_rope_freq_base(float(config.get("rope_theta") or config["rope_parameters"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])

    vocab = tokenizer["model"]["vocab"]
    added = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    tokens = [None] * config["vocab_size"]
    for token, index in {**vocab, **added}.items():
        tokens[index] = token
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in added else gguf.TokenType.NORMAL for t in tokens])
    merges = tokenizer["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_bos_token_id(config["eos_token_id"])
    if eot_token_id is not None:
        writer.add_eot_token_id(eot_token_id)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for i in range(config["num_hidden_layers"]):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    for hf_name, gguf_name in names.items():
        tensor = state[hf_name]
        if gguf_name.endswith("attn_q.weight"):
            tensor = _permute(tensor, heads)
        elif gguf_name.endswith("attn_k.weight"):
            tensor = _permute(tensor, kv_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(tensor))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
