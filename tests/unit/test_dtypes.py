"""The model dtypes, written once (engine/dtypes.py): names, sizes and torch dtypes agree."""

from __future__ import annotations

import pytest
import torch

from engine.dtypes import DTYPE_NAMES, ModelDtype, torch_dtype


@pytest.mark.parametrize("dtype", list(ModelDtype))
def test_size_and_torch_dtype_agree(dtype: ModelDtype) -> None:
    assert dtype.as_torch.itemsize == dtype.itemsize
    assert ModelDtype.of(dtype.as_torch) is dtype
    assert torch_dtype(dtype.value) is dtype.as_torch


def test_names_and_the_storage_of_codes() -> None:
    assert DTYPE_NAMES == ("float32", "bfloat16", "float16")
    assert torch_dtype("uint8") is torch.uint8
    assert ModelDtype.of(torch.uint8) is None
    with pytest.raises(ValueError):
        torch_dtype("float64")
