"""How bench/launches.py counts one call: the torch profiler's ATen operations sorted into kernel
launches and host synchronisations (`count_events`), the host-device copies made in Python that
the profiler cannot see on a CPU (`HostCalls`), and one call profiled (`profile_call`), as
`Counts` (see bench/launches.py's docstring for what each count means)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

# operations that launch no kernel: views and metadata, allocations without a fill
NO_KERNEL = frozenset(f"aten::{name}" for name in (
    "as_strided", "view", "_unsafe_view", "reshape", "_reshape_alias", "view_as", "resolve_conj",
    "resolve_neg", "result_type", "empty", "empty_strided", "empty_like", "detach", "detach_", "alias",
    "lift_fresh", "t", "transpose", "expand", "expand_as", "slice", "select", "unsqueeze", "squeeze",
    "permute", "unbind", "split", "split_with_sizes", "chunk", "narrow", "unflatten", "flatten", "numpy_T",
    "_has_compatible_shallow_copy_type", "is_nonzero", "contiguous", "to", "_to_copy", "type_as",
    "broadcast_tensors", "set_", "_nested_tensor_from_mask_left_aligned", "is_same_size", "size", "stride",
    "dim", "item", "_index_put_impl_", "index_put_", "lift_fresh_copy", "new_empty", "new_empty_strided",
))
SIZED = frozenset(f"aten::{name}" for name in ("nonzero", "nonzero_static", "masked_select", "unique",
                                               "_unique", "_unique2", "unique_dim", "unique_consecutive",
                                               "repeat_interleave"))
ITEM = "aten::_local_scalar_dense"
ASYNC_CHECK = "aten::_assert_async"  # reads its flag on a CPU; on a GPU it checks on the device, no sync


def _under(event: Any, name: str) -> bool:
    """Whether an op named `name` is among the event's callers."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == name:
            return True
        parent = parent.cpu_parent
    return False


@dataclass
class Counts:
    """One call's operations (see bench/launches.py's docstring)."""

    aten_ops: int   # ATen operations, nested ones included
    launches: int   # of them, those that launch a kernel on a GPU
    syncs: int      # host synchronisations on a GPU: items + reads + sized + uploads
    items: int      # aten::_local_scalar_dense (item(), int(t), float(t), bool(t))
    reads: int      # Tensor.tolist / .cpu / .numpy
    sized: int      # outputs sized by data (nonzero, masked_select, unique, ...)
    uploads: int    # tensors made from host data straight on a device (torch.tensor, as_tensor)
    ms: float = 0.0  # wall time of the call without the profiler, median


class HostCalls:
    """Counts, while entered, the Python calls that move data between host and device on a GPU
    (Tensor.tolist / cpu / numpy; torch.tensor / as_tensor of host data): on a CPU they run no
    ATen operation the profiler could see."""

    READS = ("tolist", "cpu", "numpy")
    UPLOADS = ("tensor", "as_tensor")

    def __init__(self) -> None:
        self.reads = 0
        self.uploads = 0
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrap(self, owner: Any, name: str, counter: str, when: Callable[..., bool]) -> None:
        original = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            if when(*args, **kwargs):
                setattr(self, counter, getattr(self, counter) + 1)
            return original(*args, **kwargs)

        self._saved.append((owner, name, original))
        setattr(owner, name, counted)

    def __enter__(self) -> "HostCalls":
        for name in self.READS:
            self._wrap(torch.Tensor, name, "reads", lambda *args, **kwargs: True)
        for name in self.UPLOADS:
            self._wrap(torch, name, "uploads", _blocking_upload)
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


def _blocking_upload(data: Any = None, *args: Any, device: Any = None, **kwargs: Any) -> bool:
    """torch.tensor / as_tensor of host data straight onto a device (`device=` given): from
    pageable memory, a copy that blocks the host. Host data made on the host (then copied from
    pinned memory with non_blocking=True, as specdec.runtime.transfer.upload does on a GPU) is
    not counted, nor is a tensor given to them."""
    return device is not None and not isinstance(data, torch.Tensor)


def count_events(events: Any, host: HostCalls) -> Counts:
    """Counts of one profiled call from the profiler's events (torch.autograd FunctionEvent)."""
    aten = [e for e in events if e.name.startswith("aten::")]
    launches: dict[int, bool] = {}

    def launches_kernel(event: Any) -> bool:
        """An op launches a kernel when it is no metadata op and no op below it launches one."""
        key = id(event)
        if key not in launches:
            below = [launches_kernel(c) for c in event.cpu_children if c.name.startswith("aten::")]
            launches[key] = event.name not in NO_KERNEL and not any(below)
        return launches[key]

    kernels = sum(launches_kernel(e) for e in aten)
    items = sum(e.name == ITEM and not _under(e, ASYNC_CHECK) for e in aten)
    sized = sum(e.name in SIZED for e in aten)
    return Counts(len(aten), kernels, items + host.reads + sized + host.uploads, items, host.reads, sized,
                  host.uploads)


def profile_call(fn: Callable[[], Any]) -> tuple[Any, Counts]:
    """Run fn once under the profiler: (its result, its counts)."""
    from torch.profiler import ProfilerActivity, profile

    with HostCalls() as host, profile(activities=[ProfilerActivity.CPU]) as prof:
        result = fn()
    return result, count_events(prof.events(), host)
