"""The graph engine (`--backend graph`): static-shape Llama / Qwen2 / Mistral model code over a
paged K/V pool, captured in CUDA graphs per bucket where CUDA is present (run eagerly, same
code, elsewhere), and its device loops: a batch's drafting and acceptance decided on the device,
one host read per batch.

`engine.py` (`GraphEngine`, the services' engine over the pool and the CUDA-graph runner),
`paged_kv.py` holds the pool and the sessions' block tables, `batch.py` lays a forward out in
static-shape tensors, `model.py` is the decoder and `cuda_graphs.py` the CUDA-graph runner
(`CudaGraphRunner`) the engine calls; `draft_loop.py` and `tree_loop.py` the draft's loops on the
device; `device_drafting.py` and `device_verification.py` the engine's `Drafting` and
`Verification` over them, with `batched_proposal.py` (a batch's proposals and draws) and
`batched_tree_drafting.py` (a depth of every tree of a batch). The acceptance step they decide
on the device is specdec/maths/batched_acceptance.py and batched_tree_acceptance.py, beside the
reference it must agree with.

Decides: how a batch runs on the pool: its static shapes, graphs and device loops.
May import: the shared library and the runtime's bottom (specdec/runtime/'s own modules, not
`engines.py`); no other engine, not `serving`.
"""
