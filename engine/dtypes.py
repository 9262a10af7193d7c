"""The model dtypes pdserve serves, written once: name, bytes per element, torch dtype.

Torch-free at import (the router and the layout use the names and sizes): the torch dtype is
looked up only when asked for.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class ModelDtype(enum.Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"

    @property
    def itemsize(self) -> int:
        return 4 if self is ModelDtype.FLOAT32 else 2

    @property
    def as_torch(self) -> torch.dtype:
        import torch

        dtype: torch.dtype = getattr(torch, self.value)
        return dtype

    @classmethod
    def of(cls, dtype: torch.dtype) -> ModelDtype | None:
        """The model dtype of a torch dtype, or None (say, a uint8 cache of codes)."""
        return next((d for d in cls if d.as_torch == dtype), None)


DTYPE_NAMES = tuple(d.value for d in ModelDtype)


def torch_dtype(name: str) -> torch.dtype:
    """A model dtype's torch dtype by name; also ``uint8``, a quantized KV cache's storage."""
    if name == "uint8":
        import torch

        return torch.uint8
    return ModelDtype(name).as_torch
