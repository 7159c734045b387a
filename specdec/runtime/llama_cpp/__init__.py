"""The llama.cpp engine (`--backend llama.cpp`): a .gguf file served quantised through
llama-cpp-python, one llama.cpp context per service in which a session is one sequence.
`engine.py` (`LlamaCppEngine`, `LlamaOptions`).

Decides: how a batch of rows runs one llama.cpp decode over the sessions' sequences.
May import: the shared library and the runtime's bottom (specdec/runtime/'s own modules, not
`engines.py`); no other engine, not `serving`.
"""
