"""One forward over several sessions: a transformers Cache built from their K/V buffers.

Rows of different lengths share a forward. Each row's history (its K/V buffer) is placed
right-aligned before column P (P = the longest history); the new tokens are left-padded so that
every row's last token is the batch's last position (one `logits_to_keep` serves all rows) and
go in columns [P, P + n). A 4-D float mask lets each real query see its own history and its
own new tokens up to itself; padding sees only itself, and nobody sees padding. `position_ids`
give each row its own positions. After the forward, each row's new K/V are written back into
its buffer. A single row needs no copy at all: the cache is a view of the session's buffer.

Host data (token ids, positions, lengths, a tree's shape) reaches the device through `upload`
(specdec/runtime/transfer.py).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from specdec.maths.tree import TokenTree
from specdec.runtime.torch.kv_buffers import KVBuffer, KVSpec
from specdec.runtime.transfer import upload

log = logging.getLogger(__name__)

MASKABLE_ATTENTION = ("sdpa", "eager")  # attention implementations that take a 4-D float mask


class BufferLayer(CacheLayerMixin):
    """One layer's K/V for one forward: kv [2, B, heads, T, dim]; the new tokens go at `start`."""

    is_sliding = False
    is_croppable = False

    def __init__(self, kv: torch.Tensor, start: int):
        super().__init__()
        self.kv = kv
        self.start = start
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """key/value_states [B, heads, n, dim] -> keys, values [B, heads, start + n, dim]."""
        end = self.start + key_states.shape[-2]
        self.kv[0, :, :, self.start:end] = key_states
        self.kv[1, :, :, self.start:end] = value_states
        return self.kv[0, :, :, :end], self.kv[1, :, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.start + query_length, 0

    def get_seq_length(self) -> int:
        return self.start

    def get_max_length(self) -> int:
        return -1


class BufferCache(Cache):
    """The cache one batched forward sees (one BufferLayer per model layer)."""

    def __init__(self, per_layer: torch.Tensor, start: int):
        """per_layer: [layers, 2, B, heads, T, dim]."""
        super().__init__(layers=[BufferLayer(per_layer[i], start) for i in range(per_layer.shape[0])])


def attention_mask(pasts: Sequence[int], lengths: Sequence[int], n: int, dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    """The additive mask of a batch -> [B, 1, n, P + n] (0 where attended, dtype min elsewhere)."""
    P = max(pasts)
    past = upload(list(pasts), torch.long, device)[:, None, None]  # [B, 1, 1]
    pad = n - upload(list(lengths), torch.long, device)[:, None, None]  # [B, 1, 1]
    i = torch.arange(n, device=device)[None, :, None]  # [1, n, 1] query
    j = torch.arange(P + n, device=device)[None, None, :]  # [1, 1, P+n] key
    real = i >= pad  # [B, n, 1]
    history = (j >= P - past) & (j < P)
    new = (j >= P + pad) & (j <= P + i)
    allowed = (real & (history | new)) | (~real & (j == P + i))  # [B, n, P+n]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def ancestor_rows(tree: TokenTree) -> list[list[bool]]:
    """rows[i][j]: node i attends to node j, its ancestor or itself (host lists, n x n)."""
    rows: list[list[bool]] = []
    for i, parent in enumerate(tree.parents):
        row = list(rows[parent - 1]) if parent else [False] * len(tree)  # parents come first: complete
        row[i] = True
        rows.append(row)
    return rows


def ancestor_mask(tree: TokenTree, device: torch.device | str = "cpu") -> torch.Tensor:
    """mask[i, j]: node i attends to node j, its ancestor or itself -> [n, n] bool (built on
    the host, one upload: no operation per node on the device)."""
    return upload(ancestor_rows(tree), torch.bool, device)


def place_trees(mask: torch.Tensor, positions: torch.Tensor, pasts: Sequence[int], lengths: Sequence[int],
                trees: Sequence[TokenTree | None]) -> None:
    """Make each row's tree nodes attend to the history before the tree and to their own
    ancestors only, each at the position of its depth after the token before the tree. A row's
    tree is the last len(tree) tokens of its session once this forward has run: new ones (its
    last tokens) and, when a tree grows depth by depth, nodes already cached (the history's last
    tokens). mask [B, 1, n, P + n] (additive), positions [B, n]; in place."""
    n, keys = positions.shape[1], mask.shape[-1]
    P = keys - n
    blocked = torch.finfo(mask.dtype).min
    for b, (past, length, tree) in enumerate(zip(pasts, lengths, trees)):
        if tree is None or len(tree) == 0:
            continue
        m = len(tree)
        new = min(m, length)  # nodes run now (the row's last tokens)
        cached = m - new      # nodes the session holds already (its history's last tokens)
        sees = ancestor_mask(tree, mask.device)[cached:]  # [new, m]: the new nodes' rows
        block = torch.zeros(sees.shape, dtype=mask.dtype, device=mask.device).masked_fill_(~sees, blocked)
        mask[b, 0, n - new:, keys - new:] = block[:, cached:]
        if cached:
            mask[b, 0, n - new:, P - cached:P] = block[:, :cached]
        root = past + length - m - 1  # the position of the token before the tree
        depths = upload(tree.depths()[cached:], positions.dtype, positions.device)  # [new]
        positions[b, n - new:] = root + depths


def position_ids(pasts: Sequence[int], lengths: Sequence[int], n: int, device: torch.device) -> torch.Tensor:
    """[B, n]: row b's real tokens at pasts[b], pasts[b] + 1, ...; padding at 0."""
    rows = [[0] * (n - length) + list(range(past, past + length)) for past, length in zip(pasts, lengths)]
    return upload(rows, torch.long, device)


def input_ids(token_rows: Sequence[Sequence[int]], n: int, device: torch.device) -> torch.Tensor:
    """[B, n]: each row left-padded (with id 0, never attended)."""
    return upload([[0] * (n - len(t)) + list(t) for t in token_rows], torch.long, device)


def single_cache(buffer: KVBuffer, past: int) -> BufferCache:
    """A view of one session's buffer: the forward writes its new K/V in place."""
    return BufferCache(buffer.data.unsqueeze(2), past)  # [layers, 2, 1, heads, cap, dim]


def gather(buffers: Sequence[KVBuffer], pasts: Sequence[int], n: int, spec: KVSpec) -> torch.Tensor:
    """The rows' histories, right-aligned before column P -> [layers, 2, B, heads, P + n, dim]."""
    P = max(pasts)
    kv = torch.zeros((spec.layers, 2, len(buffers), spec.kv_heads, P + n, spec.head_dim),
                     dtype=spec.dtype, device=spec.device)
    for b, (buffer, past) in enumerate(zip(buffers, pasts)):
        if past:
            kv[:, :, b, :, P - past:P] = buffer.data[:, :, :, :past]
    return kv


def scatter(kv: torch.Tensor, buffers: Sequence[KVBuffer], pasts: Sequence[int],
            lengths: Sequence[int]) -> None:
    """Write each row's new K/V (the last lengths[b] columns of kv) into its buffer."""
    end = kv.shape[4]
    for b, (buffer, past, length) in enumerate(zip(buffers, pasts, lengths)):
        buffer.data[:, :, :, past:past + length] = kv[:, :, b, :, end - length:end]


def buffered_spec(model: Any, device: torch.device, dtype: torch.dtype) -> tuple[KVSpec | None, str]:
    """(the K/V layout of one token, "") when this model's cache can live in buffers; else
    (None, why not)."""
    config = model.config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in MASKABLE_ATTENTION:
        return None, f"attention implementation {implementation!r} does not take a 4-D mask"
    try:
        layers = DynamicCache(config=config).layers
    except Exception as exc:  # noqa: BLE001 - any config the cache cannot read
        return None, f"cannot read the cache layout from the config ({exc})"
    odd = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer})
    if odd:
        return None, f"cache layers {', '.join(odd)} (sliding window or linear attention)"
    probe = DynamicCache()
    with torch.inference_mode():
        one = torch.ones((1, 1), dtype=torch.long, device=device)
        model(input_ids=one, attention_mask=one, cache=probe, use_cache=True)
    shapes = {tuple(layer.keys.shape) for layer in probe.layers} | {tuple(layer.values.shape) for layer in probe.layers}
    if len(shapes) != 1 or (layers and len(probe.layers) != len(layers)):
        return None, f"layers with different K/V shapes {sorted(shapes)}"
    _, heads, _, dim = shapes.pop()
    return KVSpec(len(probe.layers), heads, dim, dtype, device), ""
