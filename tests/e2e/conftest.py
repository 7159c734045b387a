"""The e2e tier's fixtures: a draft close to the target, and the HTTP API of a module's cluster.

A module that uses `base_url` or `model_id` defines `http_cluster`, its Cluster with the HTTP API
on (`coordinator={"http_port": -1}`) and whatever else it needs."""

from __future__ import annotations

import pytest


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
def base_url(http_cluster):
    """The HTTP API of the module's own `http_cluster` fixture (a Cluster with http_port set)."""
    return f"http://127.0.0.1:{http_cluster.coordinator.http_port}"


@pytest.fixture(scope="module")
def model_id(http_cluster):
    """The model name the module's `http_cluster` serves (the first of its served names)."""
    return http_cluster.coordinator.served_model_names[0]
