"""The graph engine: static-shape Llama / Qwen2 / Mistral model code over a paged K/V pool,
captured in CUDA graphs per bucket where CUDA is present (run eagerly, same code, elsewhere).

paged_kv.py holds the pool and the sessions' block tables, batch.py lays a forward out in
static-shape tensors, model.py is the decoder and cuda_graphs.py the CUDA-graph runner the engine calls.
"""
