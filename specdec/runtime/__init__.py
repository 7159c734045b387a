"""The model runtime of the draft and target services: the engines that run a model, and the
plumbing that runs the services' calls on one (no gRPC).

Its rooms (tests/test_layers.py holds each to what it may import):

* the bottom, this folder's own modules: the engine contract (`engine.py`: `ModelEngine`, the
  `Drafting` and `Verification` protocols, the call records `ProposeCall` and `VerifyCall`) and
  what the engines share — the session half (`session_kv.py`, `SessionKV`, over `kv_cache.py`),
  the warm-up and the host loops (`session_engine.py`, `drafting.py`, `tree_drafting.py`,
  `verification.py`), the target's heads (`heads.py`, `target_heads.py`), loading a transformers
  checkpoint (`loader.py`, `quantize.py`, `prepack.py`: the torch and graph engines load
  through it), the K/V tier (`kv_tier.py`), `generators.py` and `transfer.py`;
* one room per engine, each behind the contract: `specdec.runtime.torch` (`TorchEngine`),
  `specdec.runtime.llama_cpp` (`LlamaCppEngine`), `specdec.runtime.graph` (`GraphEngine`);
* `specdec.runtime.serving`: the model worker, the batch scheduler and the calls on them;
* `engines.py` at the top: the factory (`engine_from_config`, `--backend`).

Decides: how a model service's model runs a session's forwards, its drafting and its
verification (the acceptance rule itself is specdec/maths').
May import: the shared library (`specdec`, `specdec.maths`, `specdec.kv`), never the services.
The bottom imports no room and not the factory; `engine.py`, the contract, imports of the
runtime only the types its methods take (`kv_cache`, `session_kv`); only `engines.py` imports
the engines.
"""
