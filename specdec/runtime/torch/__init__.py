"""The torch engine (`--backend torch`): a transformers model on torch, its sessions' K/V in
buffers it grows itself. `engine.py` (`TorchEngine`), `batch_cache.py` (one forward over several
sessions: a transformers Cache over their buffers, the masks and positions of ragged rows and
trees), `kv_buffers.py` (a session's K/V buffer; a DynamicCache where a buffer cannot hold it).

Decides: how a batch of ragged rows runs one transformers forward over the sessions' buffers.
May import: the shared library and the runtime's bottom (specdec/runtime/'s own modules, not
`engines.py`); no other engine, not `serving`.
"""
