"""Counting host syncs on any device: a `TorchDispatchMode` records every op that reads a device
value into Python (``aten._local_scalar_dense`` behind ``.item()``, ``bool(t)``, ``int(t)``,
``float(t)``; ``aten.is_nonzero``; ``aten.equal``; copies to the CPU from another device). On a
CPU tensor these ops are free, but on an accelerator each one stalls the host until the device
catches up, breaks CUDA graphs and ends a ``torch.compile(fullgraph=True)`` graph, so the fast
paths must have none."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = frozenset({"aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal", "aten::item"})


class HostSyncCounter(TorchDispatchMode):
    """Record the host syncs of the ops run under it (``.syncs``: op name -> count)."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        name = func._schema.name
        if name in SYNC_OPS:
            self.syncs[name] += 1
        elif name == "aten::_to_copy" and kwargs and kwargs.get("device") is not None:
            src = args[0].device if isinstance(args[0], torch.Tensor) else None
            if torch.device(kwargs["device"]).type == "cpu" and src is not None and src.type not in ("cpu", "meta"):
                self.syncs["copy-to-cpu"] += 1
        return func(*args, **(kwargs or {}))


def host_syncs(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Counter[str]:
    """The host syncs of ``fn(*args, **kwargs)`` (empty when there are none)."""
    with HostSyncCounter() as counter:
        fn(*args, **kwargs)
    return counter.syncs
