"""Which engine runs a model service's model (--backend), and building its runner."""

from __future__ import annotations

import importlib.util

from specdec.runtime.session_runner import SessionRunner
from specdec.tokenizer import ModelLoadError
from specdec.types import Backend, Quantization


def llama_cpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def resolve_backend(backend: str, model: str, llama_cpp_available: bool | None = None) -> Backend:
    """The engine --backend names; AUTO is llama.cpp for a .gguf file when llama-cpp-python is
    installed, else torch. ModelLoadError for llama.cpp with something other than a .gguf file."""
    try:
        backend = Backend(backend)
    except ValueError:
        raise ModelLoadError(f"unknown backend {backend!r}; choose from {', '.join(b.value for b in Backend)}") from None
    is_gguf = model.endswith(".gguf")
    if backend == Backend.AUTO:
        available = llama_cpp_installed() if llama_cpp_available is None else llama_cpp_available
        return Backend.LLAMA_CPP if is_gguf and available else Backend.TORCH
    if backend == Backend.LLAMA_CPP and not is_gguf:
        raise ModelLoadError(f"--backend llama.cpp serves a .gguf file; {model!r} is not one "
                             "(use --backend torch for a directory or a hub id)")
    return backend


def runner_from_config(config) -> SessionRunner:
    """Load the model of a ModelServiceConfig on its engine, with its cache bounds."""
    backend = resolve_backend(config.backend, config.model)
    if backend == Backend.LLAMA_CPP:
        from specdec.runtime.llama_runner import LlamaOptions, LlamaRunner

        options = LlamaOptions(threads=config.threads, kv_cache_type=config.kv_cache_type,
                               kv_cache_tokens=config.kv_cache_tokens,
                               batch_tokens=max(config.prefill_chunk, 64), device=config.device)
        return LlamaRunner(config.model, config.max_sessions, config.kv_cache_bytes,
                           config.max_speculative_tokens, config.prefill_chunk, options)
    import torch

    from specdec.runtime.kv_cache import SessionCaches
    from specdec.runtime.loader import load_model
    from specdec.runtime.runner import ModelRunner

    if config.threads:
        torch.set_num_threads(config.threads)
    loaded = load_model(config.model, config.dtype, config.device, config.trust_remote_code,
                        getattr(config, "quantize", Quantization.NONE))
    caches = SessionCaches(config.max_sessions, config.kv_cache_bytes)
    return ModelRunner(loaded, caches, config.max_speculative_tokens, config.prefill_chunk)
