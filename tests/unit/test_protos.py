"""The committed stubs are what protos/generate.py produces from the .proto files."""

from __future__ import annotations

import importlib.util
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("generate", ROOT / "protos" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_are_fresh(tmp_path):
    written = _generator().generate(tmp_path)
    assert len(written) >= 12
    for path in written:
        committed = ROOT / "specdec" / "v1" / path.name
        assert committed.is_file(), f"{path.name} is not committed: run python protos/generate.py"
        assert committed.read_text() == path.read_text(), (
            f"specdec/v1/{path.name} is stale: run python protos/generate.py")


def test_every_field_and_enum_is_commented():
    for proto in (ROOT / "protos" / "specdec" / "v1").glob("*.proto"):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            is_field = stripped.endswith(";") and "=" in stripped and not stripped.startswith(("option", "syntax"))
            is_rpc = stripped.startswith("rpc ")
            if is_field or is_rpc:
                previous = lines[i - 1].strip()
                assert previous.startswith("//"), f"{proto.name}:{i + 1} has no comment: {stripped}"
        assert "package specdec.v1;" in proto.read_text()
    common = (ROOT / "protos" / "specdec" / "v1" / "common.proto").read_text()
    assert "FINISH_REASON_UNSPECIFIED = 0;" in common
