"""specdec: distributed speculative decoding.

This package is the shared library beneath the three services (``coordinator``,
``draft_service``, ``target_service``) and the command line (``specdec_cli``), and
imports none of them: they compose it from above. It holds

* what every service uses, no gRPC and no torch: ``types``, ``config``, ``errors``,
  ``rng`` (per-request seeds), ``fingerprint`` (of token prefixes), ``logtag``,
  ``metrics``, ``models`` (fetching the default pair) and ``tokenizer`` (loading a
  tokenizer and fingerprinting its vocabulary; transformers only once one is loaded);
* the torch math of a round: ``sampling``, ``acceptance``, ``draft_q``, and ``tiny``
  (tiny random models for tests, demos and benchmarks);
* ``specdec.runtime``: the model runtime of the draft and target services (torch +
  transformers, no gRPC);
* ``specdec.v1``: the generated protobuf stubs, and ``specdec.rpc``: the gRPC plumbing
  the servers and their clients share (status mapping, server set-up, pb conversion,
  security, health checks and channels).
"""

__version__ = "0.1.0"
