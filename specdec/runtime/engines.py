"""The factory, above the engines: which engine runs a model service's model (--backend), and
building it (`engine_from_config`). The only runtime module that imports the engines' rooms;
the services build their engine here and call it through the contract (engine.py)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging

from specdec.runtime.engine import ModelEngine
from specdec.tokenizer import ModelLoadError
from specdec.types import Backend, Quantization

log = logging.getLogger(__name__)


def llama_cpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def model_type(model: str) -> str | None:
    """The checkpoint's config.model_type (llama, qwen2, ...), None when it cannot be read."""
    from transformers import AutoConfig

    from specdec.tokenizer import model_source

    try:
        source, extra = model_source(model)
        return getattr(AutoConfig.from_pretrained(source, **extra), "model_type", None)
    except Exception:  # noqa: BLE001 - unreadable here: the load reports why, on the torch engine
        return None


def resolve_backend(backend: str, model: str, llama_cpp_available: bool | None = None,
                    device: str = "cpu", quantize: str = Quantization.NONE) -> Backend:
    """The engine --backend names; AUTO is llama.cpp for a .gguf file when llama-cpp-python is
    installed, the graph engine on CUDA for the architectures it covers (plain weights: not
    with --quantize int8/int4), else torch.
    ModelLoadError for llama.cpp with something other than a .gguf file."""
    try:
        backend = Backend(backend)
    except ValueError:
        raise ModelLoadError(f"unknown backend {backend!r}; choose from {', '.join(b.value for b in Backend)}") from None
    is_gguf = model.endswith(".gguf")
    if backend == Backend.AUTO:
        available = llama_cpp_installed() if llama_cpp_available is None else llama_cpp_available
        if is_gguf and available:
            return Backend.LLAMA_CPP
        if device.startswith("cuda") and not is_gguf and quantize not in (Quantization.INT8, Quantization.INT4):
            from specdec.runtime.graph.model import ARCHITECTURES

            if model_type(model) in ARCHITECTURES:
                return Backend.GRAPH
        return Backend.TORCH
    if backend == Backend.LLAMA_CPP and not is_gguf:
        raise ModelLoadError(f"--backend llama.cpp serves a .gguf file; {model!r} is not one "
                             "(use --backend torch for a directory or a hub id)")
    return backend


def check_memory_fraction(fraction: float, backend: Backend, device: str) -> None:
    """ModelLoadError for a --kv-cache-memory-fraction this engine and device cannot take."""
    if not fraction:
        return
    if not 0 < fraction <= 1:  # (NaN fails too)
        raise ModelLoadError(f"--kv-cache-memory-fraction must be in (0, 1] (0 = off), got {fraction}")
    if backend != Backend.GRAPH or not device.startswith("cuda"):
        raise ModelLoadError(f"--kv-cache-memory-fraction sizes the graph backend's pool on a CUDA device; "
                             f"this service runs --backend {backend} on {device}: give --kv-cache-bytes instead")


def engine_from_config(config) -> ModelEngine:
    """Load the model of a ModelServiceConfig on its engine, with its cache bounds; its
    description names the checkpoint's files (specdec/checkpoint.py)."""
    from specdec.checkpoint import checkpoint_id

    engine = _load_engine(config)
    engine.description = dataclasses.replace(engine.description, checkpoint_id=checkpoint_id(config.model))
    return engine


def _load_engine(config) -> ModelEngine:
    """The engine of a ModelServiceConfig's model on its backend."""
    backend = resolve_backend(config.backend, config.model, device=config.device,
                              quantize=getattr(config, "quantize", Quantization.NONE))
    check_memory_fraction(config.kv_cache_memory_fraction, backend, config.device)
    heads = getattr(config, "heads", "")  # a target's --heads
    if heads and backend == Backend.LLAMA_CPP:
        raise ModelLoadError(f"--heads needs the target's hidden states, which the llama.cpp backend does "
                             f"not hand out here; serve {config.model} with --backend torch or graph, or "
                             "drop --heads")
    if backend == Backend.LLAMA_CPP:
        from specdec.runtime.llama_cpp.engine import LlamaOptions, LlamaCppEngine

        options = LlamaOptions(threads=config.threads, kv_cache_type=config.kv_cache_type,
                               kv_cache_tokens=config.kv_cache_tokens,
                               batch_tokens=max(config.prefill_chunk, 64), device=config.device)
        if config.kv_store:
            log.warning("%s: no K/V store on the llama.cpp backend (its K/V pool is not cut into "
                        "chunks); --kv-store is ignored", config.model)
        return LlamaCppEngine(config.model, config.max_sessions, config.kv_cache_bytes,
                              config.max_speculative_tokens, config.prefill_chunk, options)
    import torch

    from specdec.runtime.kv_cache import SessionCaches
    from specdec.runtime.loader import load_model
    from specdec.runtime.torch.engine import TorchEngine

    if config.threads:
        torch.set_num_threads(config.threads)
    if backend == Backend.GRAPH:
        return graph_engine(config)
    loaded = load_model(config.model, config.dtype, config.device, config.trust_remote_code,
                        getattr(config, "quantize", Quantization.NONE), config.prepack, heads)
    caches = SessionCaches(config.max_sessions, config.kv_cache_bytes)
    engine = TorchEngine(loaded, caches, config.max_speculative_tokens, config.prefill_chunk)
    engine.kv_tier = kv_tier_for(engine, config)
    return engine


def graph_engine(config) -> ModelEngine:
    """The graph engine: plain (unquantized, unpacked) weights; its CUDA graphs
    captured by its warm-up, before the service starts serving."""
    from specdec.runtime.graph.engine import graph_engine_from_config
    from specdec.runtime.kv_tier import tensors_digest
    from specdec.runtime.loader import load_model

    quantize = getattr(config, "quantize", Quantization.NONE)
    if quantize in (Quantization.INT8, Quantization.INT4):
        raise ModelLoadError(f"--backend graph runs plain weights, not --quantize {quantize}; "
                             "pass --quantize none, or --backend torch")
    loaded = load_model(config.model, config.dtype, config.device, config.trust_remote_code,
                        heads=getattr(config, "heads", ""))
    engine = graph_engine_from_config(config, loaded)
    engine.kv_tier = kv_tier_for(engine, config, "graph", engine.hf_config,
                                 lambda: tensors_digest(engine.named_weights().items()))
    return engine


def kv_tier_for(engine, config, backend: str = "torch", model_config=None, digest=None):
    """The prefix cache and K/V store --prefix-cache-bytes and --kv-store ask for, where the
    engine's K/V can be cut into chunks (None otherwise, said in the log). model_config (the
    HF config) and digest (its weights' digest) default to the torch engine's model's."""
    if not config.kv_store and config.prefix_cache_bytes <= 0:
        return None
    if config.kv_chunk_tokens < 1:
        raise ValueError(f"--kv-chunk-tokens must be >= 1, got {config.kv_chunk_tokens}")
    if engine.kv_spec is None:
        log.warning("%s: no prefix cache or K/V store: its K/V is a DynamicCache per session, which is "
                    "not cut into chunks", engine.description.model_id)
        return None
    from specdec.kv.chunks import ChunkLayout, model_fingerprint
    from specdec.kv.chunk_store import open_chunk_store
    from specdec.kv.writer import ChunkWriter
    from specdec.runtime.kv_tier import KVTier, PrefixCache, weights_digest

    model_config = engine.model.config if model_config is None else model_config
    model_config = {k: v for k, v in model_config.to_dict().items() if not k.startswith("_")
                    and k != "transformers_version"}  # not the path it was loaded from
    identity = {"engine": backend, "model_id": engine.description.model_id, "dtype": engine.description.dtype,
                "config": json.dumps(model_config, sort_keys=True, default=str)}
    store = open_chunk_store(config.kv_store, config.kv_store_ttl_s)
    if store is not None:  # shared with other replicas: the weights themselves must agree
        identity["weights"] = weights_digest(engine.model) if digest is None else digest()
        identity.pop("model_id")  # a path differs between replicas; the weights do not
    cache = PrefixCache(config.prefix_cache_bytes) if config.prefix_cache_bytes > 0 else None
    tier = KVTier(model_fingerprint(identity), ChunkLayout.from_spec(engine.kv_spec, config.kv_chunk_tokens),
                  cache, store, None if store is None else ChunkWriter(store),
                  engine.read_chunk, engine.load_chunks, engine.kv_spec.device)
    log.info("%s: K/V chunks of %d tokens: prefix cache %s, store %s", engine.description.model_id,
             config.kv_chunk_tokens, f"{config.prefix_cache_bytes} bytes" if cache else "off", store or "off")
    return tier
