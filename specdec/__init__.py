"""specdec: distributed speculative decoding.

This package is the shared library beneath the three services (``coordinator``,
``draft_service``, ``target_service``) and the command line (``specdec_cli``), and
imports none of them: they compose it from above. It holds

* its foundations at the top, no gRPC and no torch: ``types``, ``config``, ``errors``,
  ``rng`` (per-request seeds), ``fingerprint`` (of token prefixes), ``logtag``, ``metrics``,
  ``cores`` (where a service computes) and ``tokenizer`` (loading a tokenizer and
  fingerprinting its vocabulary; transformers only once one is loaded);
* ``specdec.maths``: the speculative maths of a round (sampling, acceptance, the draft's q,
  log-probabilities, token trees);
* ``specdec.kv``: K/V chunks outside a service's cache (keys, byte format, the chunk store);
* ``specdec.runtime``: the model runtime of the draft and target services (torch +
  transformers or llama.cpp, no gRPC);
* ``specdec.v1``: the generated protobuf stubs, and ``specdec.rpc``: the gRPC plumbing
  the servers and their clients share (status mapping, server set-up, pb conversion,
  call streams, security, health checks and channels).

The command line's helpers (fetching the model pair, tiny random models) live with it, in
``specdec_cli``.
"""

__version__ = "0.1.0"
