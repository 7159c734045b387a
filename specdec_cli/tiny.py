"""Tiny random models built from configs with a fixed seed: for tests, demos and benchmarks.

They are saved with `save_pretrained` and loaded back through the same code
path as real checkpoints. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

EOS = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens cheaply.",
    "Le café est très chaud; über alles; señor niño. 日本語のテキスト。 Emoji: 🚀🙂✨",
    "for i in range(10):\n    print(i * i)\nclass Node:\n    def __init__(self, value):\n        self.value = value\n",
    "A target model verifies all draft tokens in one forward pass and keeps the longest prefix.",
]


def byte_level_tokenizer(vocab_size: int = 384, eos: str = EOS) -> Any:
    """A byte-level BPE tokenizer trained on a small built-in corpus (deterministic); `eos` is its
    only special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=eos)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def word_tokenizer(words: int = 12) -> Any:
    """A word-level tokenizer with a tiny vocabulary: id 0 is EOS, then w1..w{words-1}."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {EOS: 0, **{f"w{i}": i for i in range(1, words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


def model_config(arch: str, vocab_size: int, eos_token_id: int, context: int = 512, width: int = 32,
                 layers: int = 2) -> Any:
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    if arch in ("llama", "qwen2"):
        config_class = LlamaConfig if arch == "llama" else Qwen2Config
        return config_class(vocab_size=vocab_size, hidden_size=width, intermediate_size=width * 2,
                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=context, eos_token_id=eos_token_id,
                            bos_token_id=None, pad_token_id=eos_token_id, tie_word_embeddings=False)
    if arch == "gpt2":
        return GPT2Config(vocab_size=vocab_size, n_embd=width, n_layer=layers, n_head=4,
                          n_positions=context, eos_token_id=eos_token_id, bos_token_id=eos_token_id,
                          pad_token_id=eos_token_id)
    raise ValueError(f"unknown tiny architecture {arch!r}: use llama, qwen2 or gpt2")


def build_model(path: str | Path, tokenizer: Any, arch: str = "llama", seed: int = 0,
                dtype: torch.dtype = torch.float32, init_std: float = 0.5, vocab_size: int | None = None,
                **config_kwargs: Any) -> Path:
    """Build a random model with a fixed seed and save it (with its tokenizer) to path.

    init_std widens the random init so the tiny model's distributions are not flat;
    vocab_size (default: the tokenizer's) sets the embedding and output size.
    """
    from transformers import AutoModelForCausalLM

    config = model_config(arch, vocab_size or len(tokenizer), tokenizer.eos_token_id, **config_kwargs)
    config.initializer_range = init_std
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_pair(root: str | Path, arch: str = "llama", draft_seed: int = 1, target_seed: int = 2,
               **kwargs: Any) -> tuple[Path, Path]:
    """A draft and a target sharing one byte-level tokenizer, under root/draft and root/target."""
    tokenizer = byte_level_tokenizer()
    root = Path(root)
    target = build_model(root / "target", tokenizer, arch, target_seed, **kwargs)
    draft_kwargs = {k: v for k, v in kwargs.items() if k != "layers"}
    draft = build_model(root / "draft", tokenizer, arch, draft_seed, layers=1, **draft_kwargs)
    return draft, target


# the demo target's layers past the first: their residual writes scaled by this (the draft is its
# first layer, so the two agree on nearly every token while the target still pays for every layer)
QUIET_LAYER_SCALE = 0.02
OUTPUT_PROJECTIONS = ("o_proj", "down_proj", "c_proj")  # llama's attention and MLP outputs, gpt2's


def quiet_later_layers(model: Any, scale: float = QUIET_LAYER_SCALE) -> None:
    """Scale the output projections of every layer but the first by `scale`: they still run (the
    target costs what its depth costs) but barely move the residual stream."""
    for name, param in model.named_parameters():
        parts = name.split(".")
        layer = next((int(p) for p in parts if p.isdigit()), 0)
        if layer > 0 and any(p in OUTPUT_PROJECTIONS for p in parts):
            with torch.no_grad():
                param.mul_(scale)


def build_demo_pair(root: str | Path, arch: str = "llama", seed: int = 2, width: int = 256,
                    layers: int = 8) -> tuple[Path, Path]:
    """`specdec models tiny`: a target of `layers` layers whose later layers are quiet, and a
    one-layer draft copied from it (its embeddings, first layer, norm and output layer), sharing
    the byte-level tokenizer: a pair that agrees, so the demo shows speculation at work, with a
    draft several times cheaper than its target. The text is still noise."""
    from transformers import AutoModelForCausalLM

    tokenizer = byte_level_tokenizer()
    root = Path(root)
    target_config = model_config(arch, len(tokenizer), tokenizer.eos_token_id, width=width, layers=layers)
    target_config.initializer_range = 0.5
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(target_config)
    quiet_later_layers(target)
    draft_config = model_config(arch, len(tokenizer), tokenizer.eos_token_id, width=width, layers=1)
    draft = AutoModelForCausalLM.from_config(draft_config)
    weights = target.state_dict()
    draft.load_state_dict({name: weights[name] for name in draft.state_dict()})
    for model, name in ((target, "target"), (draft, "draft")):
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.eos_token_id
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root / "draft", root / "target"
