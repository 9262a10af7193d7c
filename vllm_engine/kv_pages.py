"""vLLM's paged KV cache as pdserve's transfer backends see it (``engine.kv_pages``).

vLLM keeps one tensor per attention layer. A block's *page* in a layer holds its keys and
values: ``[num_kv_heads, block_size, 2 * head_dim]`` per block on vLLM's CPU backend (block
outermost), ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` per layer on the CUDA
backends (keys, then values). Either way a page is ``2 * block_size * num_kv_heads * head_dim``
elements: pdserve's slab ``(layer, 0)`` is its first half, slab ``(layer, 1)`` its second, in the
page's own element order. The bytes are opaque; the layout's ``page_layout`` names the
arrangement so that only an identical one ever receives them.

Tensor parallelism of unequal sizes moves a range of a page's heads (``engine/kv_shards.py``).
vLLM 0.32's per-layer cache is ``[num_blocks, num_kv_heads, block_size, C]`` logically (its
``KVCacheLayout`` RFC); when it is so in memory too (block-major, heads outermost in a page: the
CPU backend's), a head range is one run of each page, and ``VllmKVPages.heads`` views it as pages
of their own. The arrangement's name reads ``BH``, not the head count, so that shards of engines
of different ``tp_size`` name the same arrangement. Pages of another arrangement (the CUDA
backends' keys-then-values) refuse a head range by name.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.dtypes import ModelDtype
from engine.kv_layout import KVCacheLayout
from engine.kv_pages import SKIP_BLOCK, KVPages, SlabSpans


class PageShapeError(ValueError):
    """A KV cache tensor this connector cannot split into pages (named by its shape)."""


def page_halves(
    tensor: torch.Tensor, num_blocks: int, num_kv_heads: int = 0
) -> tuple[torch.Tensor, str]:
    """A ``[num_blocks, 2, half_page]`` view of one layer's cache (writes through it land in
    the cache), and the arrangement's name (``BH...`` when its pages are cut by heads, those of
    ``num_kv_heads``)."""
    shape = tuple(tensor.shape)
    if tensor.is_contiguous() and shape[0] == num_blocks:  # block-major pages
        dims = list(map(str, shape[1:]))
        if _heads_outermost(shape, num_kv_heads):
            dims[0] = "H"
        return tensor.view(num_blocks, 2, -1), "B" + "x".join(dims)
    if shape[:2] == (2, num_blocks) and tensor[0].is_contiguous() and tensor[1].is_contiguous():
        keys, values = tensor[0].reshape(num_blocks, -1), tensor[1].reshape(num_blocks, -1)
        if values.data_ptr() - keys.data_ptr() == keys.numel() * keys.element_size():
            # keys then values: one [2, num_blocks, page/2] region
            return tensor.view(2, num_blocks, -1).transpose(0, 1), "2xB" + "x".join(
                map(str, shape[2:])
            )
    raise PageShapeError(
        f"vLLM KV cache tensor of shape {shape} (stride {tensor.stride()}) for {num_blocks} "
        "blocks: not one block-major page per block, nor keys-then-values of one"
    )


def head_halves(tensor: torch.Tensor, num_blocks: int, first: int, count: int) -> torch.Tensor:
    """``page_halves`` of heads ``[first, first + count)`` only: each page's run of them."""
    shape = tuple(tensor.shape)
    whole = len(shape) == 4 and first >= 0 and first + count <= shape[1]
    if not (tensor.is_contiguous() and shape[0] == num_blocks and whole):
        raise PageShapeError(
            f"vLLM KV cache tensor of shape {shape} (stride {tensor.stride()}): its pages are "
            "not cut by heads (block-major [num_blocks, heads, block_size, C] only), so KV "
            "moves only between engines of the same tensor parallelism"
        )
    per_head = shape[2] * shape[3]
    pages = tensor.view(num_blocks, -1)[:, first * per_head : (first + count) * per_head]
    return pages.view(num_blocks, 2, -1)


def _heads_outermost(shape: tuple[int, ...], num_kv_heads: int) -> bool:
    return len(shape) == 4 and shape[1] == num_kv_heads


def vllm_layout(kv_cache_config: Any, fingerprint: str, page_layout: str) -> KVCacheLayout:
    """The layout of vLLM's cache (one group of attention layers, ``kv_cache_config``'s)."""
    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    dtype = ModelDtype.of(spec.dtype)
    if dtype is None:
        raise ValueError(f"pdserve moves float KV caches; vLLM's is {spec.dtype}")
    return KVCacheLayout(
        model_fingerprint=fingerprint,
        dtype=dtype.value,
        block_size=spec.block_size,
        num_layers=len(group.layer_names),
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_size,
        page_layout=page_layout,
    )


class VllmKVPages(KVPages):
    def __init__(
        self,
        layers: list[torch.Tensor],
        layout: KVCacheLayout,
        num_blocks: int,
        first_head: int | None = None,
    ) -> None:
        """``first_head``: a view of heads ``[first_head, first_head + layout.num_kv_heads)``
        of ``layers``' pages (``heads``); None: the pages whole."""
        self.layout = layout
        self.num_blocks = num_blocks
        self._layers, self._first_head = layers, first_head
        if first_head is None:
            self._halves = [page_halves(t, num_blocks)[0] for t in layers]
        else:
            count = layout.num_kv_heads
            self._halves = [head_halves(t, num_blocks, first_head, count) for t in layers]
        slab = layout.num_codes_per_slab
        if any(h.shape[-1] != slab for h in self._halves):
            raise PageShapeError(
                f"a half page holds {self._halves[0].shape[-1]} elements, a slab of layout "
                f"{layout} holds {slab}"
            )
        self._dtype = layers[0].dtype

    def heads(self, first: int, layout: KVCacheLayout) -> VllmKVPages:
        offset = self._first_head or 0
        return VllmKVPages(self._layers, layout, self.num_blocks, first_head=offset + first)

    def spans(self) -> SlabSpans:
        """Each half page (a whole page's or a head range's) is contiguous: slab ``(layer,
        kv)`` of block ``b`` is at the half's first byte plus ``b`` pages."""
        itemsize = self._halves[0].element_size()
        bases = tuple(h[0, kv].data_ptr() for h in self._halves for kv in (0, 1))
        strides = tuple(h.stride(0) * itemsize for h in self._halves for _ in (0, 1))
        device = self._halves[0].device
        device_id = (device.index or 0) if device.type == "cuda" else 0
        return SlabSpans(tuple(self._layers), bases, strides, device_id)

    def read_slabs(self, first: int, num_slabs: int, block_ids: list[int]) -> torch.Tensor:
        self.check_slabs(first, num_slabs)
        index = self._index(block_ids)
        out = torch.empty(
            (num_slabs, len(block_ids), self.layout.num_codes_per_slab),
            dtype=self._dtype,
            device=self._halves[0].device,
        )
        for i in range(num_slabs):
            layer, half = divmod(first + i, 2)
            torch.index_select(self._halves[layer][:, half], 0, index, out=out[i])
        return out.view(num_slabs, len(block_ids), *self.layout.slab_shape)

    def write_slabs(self, first: int, block_ids: list[int], data: torch.Tensor) -> None:
        expected = (len(block_ids), *self.layout.slab_shape)
        if data.dim() < 1 or tuple(data.shape[1:]) != expected or data.dtype != self._dtype:
            raise ValueError(
                f"slab data has shape {tuple(data.shape)} {data.dtype}, expected "
                f"(num_slabs, {', '.join(map(str, expected))}) {self._dtype}"
            )
        self.check_slabs(first, data.shape[0])
        keep = [i for i, b in enumerate(block_ids) if b != SKIP_BLOCK]
        flat = data.to(self._halves[0].device).reshape(data.shape[0], len(block_ids), -1)
        if len(keep) < len(block_ids):
            flat = flat[:, keep]
            block_ids = [block_ids[i] for i in keep]
        index = self._index(block_ids)
        for i in range(data.shape[0]):
            layer, half = divmod(first + i, 2)
            self._halves[layer][:, half].index_copy_(0, index, flat[i])

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        self.check_block_ids(block_ids)
        return torch.tensor(block_ids, dtype=torch.long, device=self._halves[0].device)
