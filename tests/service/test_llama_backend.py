"""The llama.cpp engine under the torch engine's exactness tests.

Here the service tests; the other tiers' are in tests/unit/test_llama_backend.py and
tests/e2e/test_llama_backend.py. The tier split shares one description: see tests/e2e/test_llama_backend.py.
"""

from __future__ import annotations

from specdec_cli import tiny
from tests.gguf_writer import write_llama_gguf
from tests.e2e.test_llama_backend import LLAMA


def test_llama_cpp_draft_of_another_vocabulary_is_refused(models, tmp_path):
    from tests.service.test_compat import _permuted, _startup_error

    permuted = _permuted(tiny.byte_level_tokenizer(), 200, 201)  # two ids swapped
    other = tiny.build_model(tmp_path / "other", permuted, "llama", seed=5, layers=1)
    draft = str(write_llama_gguf(other, tmp_path / "other.gguf"))
    message = _startup_error(draft, models["llama"]["target"], LLAMA)
    assert "different tokenizers" in message and repr(draft) in message
