"""Shared fixtures: tiny random models saved to disk, and clusters of real servers."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# hermetic: the tests never see the model pair `specdec models fetch` left on this machine
os.environ["SPECDEC_CACHE_DIR"] = tempfile.mkdtemp(prefix="specdec-test-cache-")
# torch's OpenMP threads sleep between parallel regions instead of spinning (read once, when
# torch loads: hence before any import of it). The tests' draft, target and client threads share
# a few cores; spinning workers took the cores from them, and the tiny models gain nothing from
# spinning: a tiny forward on 2 busy cores took 47 ms spinning, 4 ms sleeping. The number of
# threads is unchanged, so what the services report about their cores is as before.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from specdec_cli import tiny  # noqa: E402
from tests.cluster import Cluster  # noqa: E402
from tests.tiers import mark_by_folder  # noqa: E402


def _quiet() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


_quiet()


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """Byte-level tiny models: per architecture a target, an unrelated draft and the target again."""
    root = tmp_path_factory.mktemp("models")
    tokenizer = tiny.byte_level_tokenizer()
    out = {}
    for arch in ("llama", "gpt2"):
        out[arch] = {
            "target": str(tiny.build_model(root / arch / "target", tokenizer, arch, seed=11)),
            "draft": str(tiny.build_model(root / arch / "draft", tokenizer, arch, seed=12, layers=1)),
        }
    return out


@pytest.fixture(scope="session")
def small_vocab_models(tmp_path_factory):
    """A 12-token vocabulary pair for distribution tests.

    Sharp enough that the temperature matters (the draft sharper than the target), so a q
    computed at the wrong temperature shows in the end-to-end distribution."""
    root = tmp_path_factory.mktemp("small")
    tokenizer = tiny.word_tokenizer(12)
    return {
        "target": str(tiny.build_model(root / "target", tokenizer, "llama", seed=21, init_std=0.15)),
        "draft": str(tiny.build_model(root / "draft", tokenizer, "llama", seed=24, layers=1, init_std=0.3)),
    }


@pytest.fixture(scope="session")
def near_draft(small_vocab_models, tmp_path_factory) -> str:
    """The target with its output layer scaled by 1.2 (and its tokenizer): a draft a little
    sharper than the target, agreeing with it often, so guesses of the bonus are often right."""
    import torch
    from transformers import AutoTokenizer

    from specdec.runtime.loader import load_model

    target = small_vocab_models["target"]
    model = load_model(target, "float32").model
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(1.2)
    path = tmp_path_factory.mktemp("near-draft")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(target).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def base_url(cluster):
    """The HTTP API of the module's own `cluster` fixture (one with http_port set)."""
    return f"http://127.0.0.1:{cluster.coordinator.http_port}"


@pytest.fixture(scope="module")
def model_id(cluster):
    """The model name the module's `cluster` serves (the first of its served names)."""
    return cluster.coordinator.served_model_names[0]


@pytest.fixture(scope="module")
def llama_cluster(models):
    with Cluster(models["llama"]["draft"], models["llama"]["target"]) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A reachable Redis for tests that do not stop it: $SPECDEC_TEST_REDIS_URL (set by .ci/run),
    else a redis-server of our own on a free port."""
    url = os.environ.get("SPECDEC_TEST_REDIS_URL")
    if url:
        yield url
        return
    from tests.redis_server import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server.url
    server.stop()


@pytest.fixture
def own_redis(tmp_path):
    """A redis-server this test owns (it may stop and restart it)."""
    from tests.redis_server import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.hookimpl(tryfirst=True)  # before -m deselects anything: every collected test is checked
def pytest_collection_modifyitems(config, items):
    """Every test is in exactly one tier, the folder it is in (tests/unit/, tests/service/,
    tests/e2e/, tests/process/), so `pytest -m unit` (or service, e2e, process) runs a whole tier
    and nothing is left out of all of them (tests/tiers.py)."""
    mark_by_folder(items, Path(__file__).resolve().parent)
