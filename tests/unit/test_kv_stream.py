"""The restore path of K/V chunks: `chunk_view` (a stored value checked and viewed as a tensor

Here the unit tests; the others are in tests/service/test_kv_stream.py."""

from __future__ import annotations

import struct
import pytest
import torch
from specdec.kv.chunks import HEADER_BYTES, LAYOUT_VERSION, ChunkError, chunk_view
from specdec.kv.chunks import decode_chunk

from tests.service.test_kv_stream import LAYOUT, chunks


def test_chunk_view_shares_the_buffer_and_equals_decode():
    keys, kvs, values = chunks(1)
    buffer = bytearray(values[0])
    view = chunk_view(buffer, keys[0], LAYOUT)  # [layers, 2, kv_heads, tokens, head_dim]
    assert torch.equal(view, kvs[0]) and torch.equal(view, decode_chunk(values[0], keys[0], LAYOUT))
    buffer[HEADER_BYTES:HEADER_BYTES + 8] = struct.pack("<d", 42.0)
    assert view.view(-1)[0].item() == 42.0  # no copy: the tensor is the buffer
    assert torch.equal(chunk_view(values[0], keys[0], LAYOUT), kvs[0])  # read-only bytes: a copy


@pytest.mark.parametrize("version", [0, LAYOUT_VERSION + 1, 0xFFFF])
def test_a_chunk_of_another_format_version_is_refused_never_misread(version):
    keys, _, values = chunks(1)
    other = bytearray(values[0])
    struct.pack_into("<H", other, 4, version)  # the version field follows the 4-byte magic
    for read in (chunk_view, decode_chunk):
        with pytest.raises(ChunkError) as raised:
            read(other, keys[0], LAYOUT)
        assert raised.value.reason == "version"
