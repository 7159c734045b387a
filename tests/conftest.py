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
def long_context_pair(tmp_path_factory):
    """A draft and target with a 4,096-token context (byte-level): for prompts of thousands of tokens."""
    root = tmp_path_factory.mktemp("long")
    tokenizer = tiny.byte_level_tokenizer()
    target = tiny.build_model(root / "target", tokenizer, "llama", seed=31, context=4096, width=128, layers=3)
    draft = tiny.build_model(root / "draft", tokenizer, "llama", seed=32, context=4096, layers=1)
    return str(draft), str(target)


@pytest.fixture(scope="module")
def llama_cluster(models):
    """The llama pair served with the defaults (draft, target and coordinator in this process)."""
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
