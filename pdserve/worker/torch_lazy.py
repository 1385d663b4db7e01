"""torch for the worker's KV paths, imported on first use: a worker whose engine is emulated
(its KV blocks are bytes) never loads it. Use `from pdserve.worker.torch_lazy import torch`
where a module would `import torch`; annotations stay as written (they are strings)."""

from __future__ import annotations

from typing import Any


class _Torch:
    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch, name)


torch: Any = _Torch()
