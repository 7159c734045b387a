"""specdec: distributed speculative decoding.

This package is the shared library of the three services. Its pure modules
(``sampling``, ``acceptance``, ``rng``, ``types``, ``config``, ``errors``) and the
model runtime (``specdec.runtime``) import no gRPC; ``specdec.v1`` holds the
generated protobuf stubs and ``specdec.rpc`` the gRPC plumbing shared by the
servers.
"""

__version__ = "0.1.0"
