"""vLLM 0.33.0's canonical GPU <-> CPU copy for one worker, run on the CPU with vLLM's own code.

What a worker does under ``canonical_layout`` (``OffloadingConnectorWorker.register_kv_caches``
and ``CpuGpuOffloadingHandlers`` / ``SingleDirectionOffloadingHandler``), piece by piece:

* per layer, ``derive_canonical_mappings`` over the views vLLM's allocator creates
  (``vllm_canonical.mappings``) and one ``CanonicalKVCacheRef`` per layer, in the group's layer
  order, as ``register_kv_caches`` builds them;
* the CPU side: ``_canonical_block_sizes`` and ``SharedOffloadRegion.create_next_canonical_view``
  (vLLM's functions, over a metadata tensor of the region's size) carve each layer's canonical
  area from the start of every row;
* a transfer: ``SingleDirectionOffloadingHandler._build_copy_plan``, ``_fill_canonical_ops``
  (with ``compute_sub_block_ptrs`` and the writer rotation ``_filter_writer_blocks``) produce
  the (source address, destination address, size) descriptors; only the last step, the copy
  itself (``swap_blocks_batch``, a CUDA kernel), is done here, with ``ctypes.memmove`` between
  real buffers: a rank's "GPU" KV cache (a numpy buffer written through vLLM's views) and vLLM's
  primary region (the memory the tier under test reads and writes).

The handler's methods are called on a plain object holding exactly the attributes they read,
so nothing of vLLM's logic is re-implemented here.
"""

from __future__ import annotations

import ctypes
import functools
from types import SimpleNamespace as NS

import numpy as np
import torch
from vllm.v1.kv_cache_interface import group_kernel_blocks
from vllm.v1.kv_offload.base import CanonicalKVCacheRef
from vllm.v1.kv_offload.cpu import gpu_worker
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

import vllm_canonical as vc

_Handler = gpu_worker.SingleDirectionOffloadingHandler


def kv_value(layer, block, head, token, content_byte):
    """The KV byte the model computes at these coordinates (any fixed, well-mixed function of
    model coordinates, so it does not depend on the TP size)."""
    u = np.uint64
    x = (np.asarray(layer, dtype=u) * u(0xD6E8FEB86659FD93)
         + np.asarray(block, dtype=u) * u(0xA0761D6478BD642F)
         + np.asarray(head, dtype=u) * u(0xE7037ED1A0B428DB)
         + np.asarray(token, dtype=u) * u(0x8EBC6AF09C88C6E3)
         + np.asarray(content_byte, dtype=u) * u(0x589965CC75374CC3))
    x = (x ^ (x >> u(31))) * u(0x9E3779B97F4A7C15)
    return (x >> u(56)).astype(np.uint8)


def rank_buffer(model, tp, rank, config, views, first_block):
    """A rank's whole KV cache allocation (``config``'s one tensor) with every block written
    **through vLLM's views**: block ``b`` holds the model's KV of block ``first_block + b`` for
    the KV heads TP gives ``rank``."""
    (tensor,) = config.kv_cache_tensors
    buf = np.zeros(tensor.size, dtype=np.uint8)
    for li, name in enumerate(model.layers):
        v = views[name]
        blocks, heads, tokens, content = v.shape
        e = v.element_size()
        through_view = np.lib.stride_tricks.as_strided(
            buf[v.storage_offset() * e:],
            shape=(blocks, heads, tokens, content * e),
            strides=tuple(s * e for s in v.stride()[:3]) + (1,),
        )
        b = np.arange(blocks).reshape(-1, 1, 1, 1)
        h = np.array([vc.head_of(model, tp, rank, i) for i in range(heads)]).reshape(1, -1, 1, 1)
        t = np.arange(tokens).reshape(1, 1, -1, 1)
        c = np.arange(content * e).reshape(1, 1, 1, -1)
        through_view[...] = kv_value(li, first_block + b, h, t, c)
    return buf


class _Tensor:
    """What ``compute_sub_block_ptrs`` reads of a tensor: its address, row stride and shape."""

    def __init__(self, address: int, row_stride: int, shape: tuple[int, int]):
        self.address, self.row_stride, self.shape = address, row_stride, shape

    def data_ptr(self) -> int:
        return self.address

    def stride(self, dim: int) -> int:
        assert dim == 0
        return self.row_stride


class CanonicalWorker:
    """One rank's canonical copies between its KV cache (``gpu``, a numpy buffer laid out as
    ``config`` says) and vLLM's primary region (``region_address``, ``num_chunks`` rows of
    ``row_stride`` bytes)."""

    def __init__(self, model, tp, rank, bpc, config, views, gpu: np.ndarray,
                 region_address: int, row_stride: int, num_chunks: int):
        self.bpc, self.gpu = bpc, gpu
        mappings = vc.mappings(model, tp, rank, config, views)
        spec = config.kv_cache_groups[0].kv_cache_spec
        # register_kv_caches: one tensor and one ref per layer, in the group's layer order.
        self.refs = [
            CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=spec.unpadded_page_size_bytes,
                                mapping=mappings[name])
            for i, name in enumerate(model.layers)
        ]
        gpu_address = gpu.ctypes.data
        self.gpu_tensors = []
        for name in model.layers:
            ref = group_kernel_blocks(views[name], config.num_blocks)
            e = ref.element_size()
            self.gpu_tensors.append(_Tensor(gpu_address + ref.storage_offset() * e,
                                            ref.stride(0) * e,
                                            (config.num_blocks, spec.page_size_bytes)))
        # CpuGpuOffloadingHandlers: each layer's canonical view, carved by vLLM's region code
        # (over a metadata tensor: only offsets and strides are taken from it).
        region = NS(_base=torch.zeros(num_chunks * row_stride, dtype=torch.int8),
                    _canonical_offset=0, _row_stride=row_stride, num_chunks=num_chunks,
                    _views=[])
        sizes = gpu_worker._canonical_block_sizes([self.refs], len(self.refs))
        cpu_views = [SharedOffloadRegion.create_next_canonical_view(region, size * bpc)
                     for size in sizes]
        #: Byte offsets within a row of each layer's canonical area: (start, end).
        self.canonical_areas = [(v.storage_offset(), v.storage_offset() + v.shape[1])
                                for v in cpu_views]
        self.cpu_tensors = [_Tensor(region_address + v.storage_offset(), v.stride(0),
                                    tuple(v.shape)) for v in cpu_views]

    def _handler(self, gpu_to_cpu: bool):
        h = NS(
            gpu_to_cpu=gpu_to_cpu,
            layer_refs_per_group=[self.refs],
            _canonical_copy_plans=[[gpu_worker._build_copy_plan(r, gpu_to_cpu)
                                    for r in self.refs]],
            src_tensors=self.gpu_tensors if gpu_to_cpu else self.cpu_tensors,
            dst_tensors=self.cpu_tensors if gpu_to_cpu else self.gpu_tensors,
            src_blocks_per_chunk=1 if gpu_to_cpu else self.bpc,
            dst_blocks_per_chunk=self.bpc if gpu_to_cpu else 1,
            _scratch_bases_src=np.empty(0, dtype=np.uint64),
            _scratch_bases_dst=np.empty(0, dtype=np.uint64),
        )
        h._filter_writer_blocks = functools.partial(_Handler._filter_writer_blocks, h)
        return h

    def _transfer(self, gpu_to_cpu: bool, chunk_id: int) -> int:
        h = self._handler(gpu_to_cpu)
        gpu_blocks = np.arange(self.bpc, dtype=np.int64)
        chunks = np.array([chunk_id], dtype=np.int64)
        group_src, group_dst = (gpu_blocks, chunks) if gpu_to_cpu else (chunks, gpu_blocks)
        n = _Handler._estimate_max_copy_ops(h, [self.bpc])
        src, dst, sizes = (np.zeros(n, dtype=np.int64) for _ in range(3))
        end, nbytes = _Handler._fill_canonical_ops(
            h, 0, group_src, group_dst, self.bpc, 0, 0, src, dst, sizes, 0)
        for s, d, size in zip(src[:end].tolist(), dst[:end].tolist(), sizes[:end].tolist()):
            ctypes.memmove(d, s, size)  # swap_blocks_batch's copy
        return nbytes

    def store(self, chunk_id: int) -> int:
        """GPU blocks 0..bpc-1 -> row ``chunk_id`` (this rank's elected share); bytes copied."""
        return self._transfer(True, chunk_id)

    def load(self, chunk_id: int) -> int:
        """Row ``chunk_id`` -> GPU blocks 0..bpc-1; bytes copied."""
        return self._transfer(False, chunk_id)
