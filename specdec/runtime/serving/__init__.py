"""The services' plumbing between gRPC and an engine: `worker.py` (`ModelWorker`, the one model
thread a service's model work runs on), `scheduler.py` (`BatchScheduler`: calls gathered into
one batch per forward), `calls.py` (one Propose or Verify on the worker, long inputs in chunks).

Decides: when a call runs on the engine and with which others (the thread, the batches, the
deadlines), never how: that is the engine's.
May import: the shared library and the engine contract (`specdec.runtime.engine`) only; no
engine, none of the loops, not the factory.
"""
