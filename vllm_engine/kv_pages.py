"""vLLM's paged KV cache as pdserve's transfer backends see it (``engine.kv_pages``).

vLLM keeps one tensor per attention layer: in vLLM 0.32 a ``[num_blocks, num_kv_heads,
block_size, C]`` view (``C``: a head's keys and values of one token) of one allocation, strided
as its KV cache layout says (its ``KVCacheLayout`` RFC). A block's *page* in a layer is its
``num_kv_heads * block_size * C`` elements; in every layout pdserve moves, blocks are outermost
and a page is one contiguous run, in the layout's own element order (``_page``). pdserve's slab
``(layer, 0)`` is a page's first half, slab ``(layer, 1)`` its second. The bytes are opaque;
the layout's ``page_layout`` names the arrangement (the page's dimensions in memory order) so
that only an identical one ever receives them.

Tensor parallelism of unequal sizes moves a range of a page's heads (``engine/kv_shards.py``).
When heads are outermost in a page (vLLM's ``LBHNC`` or ``BLHNC``; pdserve's connector asks for
``LBHNC``, the CPU backend's only one), a head range is one run of each page, and
``VllmKVPages.heads`` views it as pages of their own. The arrangement's name then reads ``BH``,
not the head count, so that shards of engines of different ``tp_size`` name the same
arrangement. Pages of another arrangement (``LBNHC``, FlashAttention's default, where a backend
cannot read ``LBHNC``) carry their head count and order in their name (``B16x8x256/NHC``) and
refuse a head range by name.
"""

from __future__ import annotations

import contextlib
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
    the cache), and the arrangement's name: ``B`` and the page's dimensions in memory order,
    ``H`` for the heads when they are outermost in the page (those of ``num_kv_heads``), and
    the logical order after a ``/`` when it is not vLLM's ``[B, H, N, C]`` itself."""
    tensor = _manager_blocks(tensor, num_blocks)
    order, block_stride, page = _page(tensor, num_blocks)
    dims = [str(tensor.shape[d]) for d in order]
    if tensor.dim() == 4 and order[0] == 1 and tensor.shape[1] == num_kv_heads:
        dims[0] = "H"
    name = "B" + "x".join(dims)
    if order != sorted(order):
        name += "/" + "".join(_LOGICAL[d] if tensor.dim() == 4 else str(d) for d in order)
    halves = torch.as_strided(
        tensor, (num_blocks, 2, page // 2), (block_stride, page // 2, 1), tensor.storage_offset()
    )
    return halves, name


def head_halves(tensor: torch.Tensor, num_blocks: int, first: int, count: int) -> torch.Tensor:
    """``page_halves`` of heads ``[first, first + count)`` only: each page's run of them."""
    tensor = _manager_blocks(tensor, num_blocks)
    shape = tuple(tensor.shape)
    cut = False
    if len(shape) == 4 and first >= 0 and first + count <= shape[1]:
        with contextlib.suppress(PageShapeError):
            order, block_stride, _ = _page(tensor, num_blocks)
            cut = order[0] == 1
    if not cut:
        raise PageShapeError(
            f"vLLM KV cache tensor of shape {shape} (stride {tensor.stride()}): its pages are "
            "not cut by heads (heads outermost in each block's page, vLLM's LBHNC or BLHNC "
            "layout, only), so KV moves only between engines of the same tensor parallelism"
        )
    per_head = shape[2] * shape[3]
    run = torch.as_strided(
        tensor,
        (num_blocks, count * per_head),
        (block_stride, 1),
        tensor.storage_offset() + first * per_head,
    )
    return run.view(num_blocks, 2, -1)


# vLLM 0.32's logical axes of one layer's cache (its KVCacheLayout RFC): block, head, token,
# content (a head's keys and values of one token).
_LOGICAL = "BHNC"


def _manager_blocks(tensor: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """vLLM splits each block into kernel blocks when its attention backend takes fewer tokens
    per block (``group_kernel_blocks``): the block's kernel pages, one after the other, are its
    page (``[num_blocks, ratio, H, N, C]``)."""
    n = tensor.shape[0] if tensor.dim() else 0
    if n > num_blocks > 0 and n % num_blocks == 0:
        return tensor.unflatten(0, (num_blocks, n // num_blocks))
    return tensor


def _page(tensor: torch.Tensor, num_blocks: int) -> tuple[list[int], int, int]:
    """The dimensions of a block's page in memory order (outermost first), the block stride
    and the page size (elements), when blocks are outermost and each page is one contiguous
    run; else ``PageShapeError`` naming the shape and strides."""
    shape, stride = tuple(tensor.shape), tensor.stride()
    order = _memory_order(shape, stride)
    page, contiguous = 1, len(shape) >= 2 and shape[0] == num_blocks
    for d in reversed(order):
        if shape[d] > 1 and stride[d] != page:
            contiguous = False
        page *= shape[d]
    if not contiguous or page % 2 or (num_blocks > 1 and stride[0] < page):
        raise PageShapeError(
            f"vLLM KV cache tensor of shape {shape} (stride {stride}) for {num_blocks} "
            "blocks: not one contiguous page per block, blocks outermost"
        )
    return order, stride[0], page


def _memory_order(shape: tuple[int, ...], stride: tuple[int, ...]) -> list[int]:
    """The non-block dimensions outermost first by stride. One of size 1 (any stride) goes
    just before the first dimension, in that order, whose index is above its own (the end
    when none is), so arrangements that differ only by where a size-1 dimension sits (the same
    bytes) have one name."""
    real = sorted((d for d in range(1, len(shape)) if shape[d] > 1), key=lambda d: -stride[d])
    order: list[int] = []
    for d in real:
        order += [u for u in range(1, d) if shape[u] == 1 and u not in order]
        order.append(d)
    order += [u for u in range(1, len(shape)) if u not in order]
    return order


def _regions(layers: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """One flat tensor per allocation the layers lie in, from their first element to their
    last: a NIXL agent registers contiguous tensors, and a layer of a strided layout (``LBNHC``,
    or ``BLHNC``: every block holds each layer's page) is not one."""
    spans: dict[int, tuple[torch.Tensor, int, int]] = {}
    for t in layers:
        lo = int(t.storage_offset())
        hi = lo + sum((int(n) - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1
        key = t.untyped_storage().data_ptr()
        if key in spans:
            _, held_lo, held_hi = spans[key]
            lo, hi = min(lo, held_lo), max(hi, held_hi)
        spans[key] = (t, lo, hi)
    return tuple(torch.as_strided(t, (hi - lo,), (1,), lo) for t, lo, hi in spans.values())


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
        kv)`` of block ``b`` is at the half's first byte plus ``b`` block strides. What an
        agent registers is each allocation the layers lie in (``_regions``)."""
        itemsize = self._halves[0].element_size()
        bases = tuple(h[0, kv].data_ptr() for h in self._halves for kv in (0, 1))
        strides = tuple(h.stride(0) * itemsize for h in self._halves for _ in (0, 1))
        device = self._halves[0].device
        device_id = (device.index or 0) if device.type == "cuda" else 0
        return SlabSpans(_regions(self._layers), bases, strides, device_id)

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
