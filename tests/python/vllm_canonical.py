"""vLLM 0.33.0's own canonical-layout answers for a kvtier layout descriptor.

Everything here feeds a descriptor's geometry to vLLM's code and returns what vLLM computes;
nothing re-implements vLLM's rules:

* :func:`kv_cache_config`: the ``KVCacheConfig`` vLLM's planner builds for one group of
  layers (``compute_layout_strides`` gives the layer and block strides, as in
  ``vllm/v1/core/kv_cache_planning.py``);
* :func:`layer_views`: the per-layer views vLLM's allocator hands the attention backends
  (``create_kv_cache_views``, what ``allocate_kv_cache`` calls), over a metadata-only buffer;
* :func:`mappings`: ``derive_canonical_mappings`` for one rank;
* :func:`file_mapper`: ``build_offloading_config`` then ``FileMapper.from_offloading_spec``
  (the digest vLLM's fs tier stores under);
* :func:`oracle`: the byte oracle, which uses neither vLLM's mapping code nor kvtier's: where
  each byte of a rank's page truly belongs in the TP-1 page, from the views' strides alone.

The vLLM "model" is a few ``SimpleNamespace`` objects carrying exactly the attributes those
functions read (a missing one raises ``AttributeError``, never a silent default).
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
    derive_canonical_mappings,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.kv_offload.file_mapper import FileMapper

#: TP sizes the tests and `kvtier layout check` try.
TPS = (1, 2, 4, 8)
#: GPU blocks of the synthetic allocation (the views are metadata; any count works).
NUM_BLOCKS = 3

_TORCH_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
_VLLM_LAYOUT = {"NHD": "LBNHC", "HND": "LBHNC"}


class Model:
    """A kvtier descriptor (TOML) read with the standard library, as vLLM would see the model."""

    def __init__(self, path: Path, text: str | None = None):
        self.path = Path(path)
        self.text = self.path.read_text() if text is None else text
        d = tomllib.loads(self.text)
        self.d = d
        self.name = d["model_name"]
        self.mla = d["attention"] == "mla"
        self.layers = [d["layer_name_pattern"].replace("{i}", str(i)) for i in range(d["num_layers"])]
        self.heads = d["num_attention_heads"]
        self.kv_heads = 1 if self.mla else d["num_kv_heads"]
        self.block_size = d["tokens_per_block"]
        self.dtype = d["dtype"]
        self.torch_dtype = _TORCH_DTYPES[self.dtype]
        self.layout = KVCacheLayout[_VLLM_LAYOUT.get(d["kv_layout"], d["kv_layout"])]

    def allows(self, tp: int) -> bool:
        """vLLM's TP rule for attention heads, and KV heads that split or replicate evenly."""
        if self.heads % tp:
            return False
        return self.mla or self.kv_heads % tp == 0 or tp % self.kv_heads == 0

    def allowed_tps(self):
        return [tp for tp in TPS if self.allows(tp)]

    def spec(self, tp: int):
        if self.mla:
            return MLAAttentionSpec(
                block_size=self.block_size,
                num_kv_heads=1,
                head_size=self.d["kv_lora_rank"] + self.d["qk_rope_head_dim"],
                dtype=self.torch_dtype,
                cache_dtype_str="auto",
            )
        return FullAttentionSpec(
            block_size=self.block_size,
            num_kv_heads=max(1, self.kv_heads // tp),
            head_size=self.d["head_dim"],
            dtype=self.torch_dtype,
        )


def kv_cache_config(model: Model, tp: int, num_blocks: int = NUM_BLOCKS) -> KVCacheConfig:
    """One group, layer-outermost placement, strides from vLLM's ``compute_layout_strides``."""
    spec = model.spec(tp)
    n = len(model.layers)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, n, model.layout)
    tensor = KVCacheTensor(
        size=layer_stride * n,
        layers=list(model.layers),
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    replicas = tp if model.mla else max(1, tp // model.kv_heads)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(list(model.layers), spec)],
        kv_tp_replicas=replicas,
    )


def layer_views(model: Model, tp: int, config: KVCacheConfig | None = None,
                raw=None) -> dict:
    """``{layer_name: view}`` exactly as vLLM's allocator creates them: metadata only, or over
    ``raw`` (``torch.frombuffer`` of a real buffer of the allocation's size)."""
    config = config or kv_cache_config(model, tp)
    (tensor,) = config.kv_cache_tensors
    if raw is None:
        raw = torch.zeros(tensor.size, dtype=torch.int8)
    spec = config.kv_cache_groups[0].kv_cache_spec
    views = create_kv_cache_views(raw, spec, config.num_blocks, model.layout, tensor)
    return dict(zip(tensor.layers, views))


def views_json(model: Model, views: dict) -> list:
    """``views`` (``{layer_name: view}``) in layer order as kvtier reads them: ``{"shape",
    "stride" (elements), "element_size"}`` each."""
    return [{"shape": list(views[n].shape), "stride": list(views[n].stride()),
             "element_size": views[n].element_size()} for n in model.layers]


def vllm_config(model: Model, tp: int, rank: int, *, canonical: bool = True, bpc: int = 1,
                extra: dict | None = None, engine_id: str = "kvtier-canonical-test"):
    """The attributes of a ``VllmConfig`` that vLLM's offloading code reads (``extra``: more
    ``kv_connector_extra_config`` keys, e.g. the tiering spec's)."""
    cache_dtype = "auto" if model.dtype in ("bfloat16", "float16", "float32") else model.dtype
    return NS(
        parallel_config=NS(
            tensor_parallel_size=tp,
            pipeline_parallel_size=1,
            prefill_context_parallel_size=1,
            decode_context_parallel_size=1,
            cp_kv_cache_interleave_size=1,
            world_size=tp,
            rank=rank,
            distributed_executor_backend="mp",
            nnodes_within_dp=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
        ),
        model_config=NS(
            model=model.name,
            use_mla=model.mla,
            dtype=model.dtype,
            max_model_len=4096,
            get_total_num_kv_heads=lambda: model.kv_heads,
        ),
        cache_config=NS(
            block_size=model.block_size,
            prefix_match_unit=None,
            enable_prefix_caching=True,
            cache_dtype=cache_dtype,
            kv_cache_layout=model.layout.name,
        ),
        kv_transfer_config=NS(
            kv_connector_extra_config={
                **(extra or {}), "canonical_layout": canonical, "blocks_per_chunk": bpc,
            },
            engine_id=engine_id,
        ),
        use_v2_model_runner=False,
        kv_events_config=None,
    )


def mappings(model: Model, tp: int, rank: int, config=None, views=None) -> dict:
    """``derive_canonical_mappings`` for ``rank``: ``{layer_name: CanonicalPageMapping}``."""
    config = config or kv_cache_config(model, tp)
    views = views if views is not None else layer_views(model, tp, config)
    return derive_canonical_mappings(vllm_config(model, tp, rank), config, views)


def file_mapper(model: Model, tp: int, *, canonical: bool, bpc: int) -> FileMapper:
    """The ``FileMapper`` vLLM's fs tier builds (``parallel_agnostic=True``, as it asks)."""
    config = kv_cache_config(model, tp)
    offloading = build_offloading_config(
        vllm_config(model, tp, 0, canonical=canonical, bpc=bpc), config
    )
    return FileMapper.from_offloading_spec(
        "/root", NS(config=offloading), blocks_per_file=bpc, parallel_agnostic=True
    )


def head_of(model: Model, tp: int, rank: int, local_head: int) -> int:
    """The model's KV head that ``local_head`` of ``rank`` holds: TP shards KV heads in
    contiguous ranges, and with fewer KV heads than ranks each head is held by ``tp / heads``
    consecutive ranks (MLA's one latent is held whole by every rank)."""
    if model.mla:
        return 0
    if model.kv_heads >= tp:
        return rank * (model.kv_heads // tp) + local_head
    return rank // (tp // model.kv_heads)


def _element_offsets(view) -> np.ndarray:
    """Byte offset of every byte of block 0's page, relative to the page start, indexed by
    (head, token, element, byte) in the view's logical order."""
    _, heads, tokens, content = view.shape
    _, sh, st, sc = view.stride()
    elem = view.element_size()
    h = np.arange(heads).reshape(-1, 1, 1, 1)
    t = np.arange(tokens).reshape(1, -1, 1, 1)
    c = np.arange(content).reshape(1, 1, -1, 1)
    b = np.arange(elem).reshape(1, 1, 1, -1)
    return (h * sh + t * st + c * sc) * elem + b


def oracle(model: Model, tp: int, rank: int, layer: str, local_views=None, tp1_views=None):
    """For every byte of ``rank``'s page of ``layer`` (by local byte offset), its offset in the
    TP-1 page, computed from the two views' shapes and strides alone."""
    local_views = local_views or layer_views(model, tp)
    tp1_views = tp1_views or layer_views(model, 1)
    local, whole = local_views[layer], tp1_views[layer]
    assert local.shape[2:] == whole.shape[2:], "a rank's page holds whole tokens and heads"
    local_off = _element_offsets(local)
    heads = np.array([head_of(model, tp, rank, h) for h in range(local.shape[1])])
    whole_off = _element_offsets(whole)[heads]
    page = local_off.size
    out = np.full(page, -1, dtype=np.int64)
    out[local_off.ravel()] = whole_off.ravel()
    assert (out >= 0).all() and np.unique(local_off).size == page, "the view covers its page"
    return out


def place(runs, local_page: int) -> np.ndarray:
    """Where a mapping's copy runs put each local byte (-1: nowhere; a byte copied twice
    fails). ``runs``: dicts or objects with vLLM's ``CopyRun`` field names."""
    out = np.full(local_page, -1, dtype=np.int64)
    for r in runs:
        g = r if isinstance(r, dict) else dataclasses.asdict(r)
        size = g["fragment_size"]
        for i in range(g["num_fragments"]):
            lo = g["local_offset"] + i * g["local_stride"]
            co = g["canonical_offset"] + i * g["canonical_stride"]
            assert lo + size <= local_page, f"run {g} reaches past the local page"
            assert (out[lo:lo + size] == -1).all(), f"run {g} copies a byte twice"
            out[lo:lo + size] = np.arange(co, co + size)
    return out


def coalesced(runs):
    """kvtier's runs (dicts) coalesced by vLLM's own ``_coalesce_runs``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
        _coalesce_runs,
    )
    from vllm.v1.kv_offload.base import CopyRun

    return _coalesce_runs([CopyRun(**r) for r in runs])


def layer_difference(where: str, vllm_m, kvtier_layer: dict) -> str | None:
    """None when kvtier's layer mapping equals vLLM's ``CanonicalPageMapping``, else the first
    difference."""
    if kvtier_layer["kind"] != "certified":
        return f"{where}: kvtier {kvtier_layer['kind']} ({kvtier_layer['reason']}), vLLM certified"
    for key in ("canonical_page_size_bytes", "local_page_size_bytes", "num_writers",
                "writer_index", "parallelism_agnostic"):
        if getattr(vllm_m, key) != kvtier_layer[key]:
            return f"{where}: {key}: vLLM {getattr(vllm_m, key)} != kvtier {kvtier_layer[key]}"
    ours = coalesced(kvtier_layer["runs"])
    if tuple(vllm_m.runs) != ours:
        return f"{where}: runs differ:\n  vLLM   {vllm_m.runs}\n  kvtier {ours}"
    return None


def misplaced(model: Model, tp: int, rank: int, layer: str, runs, local_views, tp1_views):
    """(bytes the runs put elsewhere than the oracle says, bytes of the page)."""
    truth = oracle(model, tp, rank, layer, local_views, tp1_views)
    placed = place(runs, truth.size)
    return int(np.count_nonzero(placed != truth)), truth.size


def compare(model: Model, tp: int, answer: dict) -> tuple[int, list[str]]:
    """kvtier's canonical answer for ``tp`` (``ranks[r].layers``, as ``kvtier-replay
    canonical`` and ``kvtier layout check`` give it) against vLLM: every rank's and layer's
    mapping, and the byte oracle on the first and last layer. Returns (layer mappings
    compared, differences)."""
    config = kv_cache_config(model, tp)
    views = layer_views(model, tp, config)
    tp1_views = layer_views(model, 1)
    compared, differences = 0, []
    for rank in range(tp):
        theirs = mappings(model, tp, rank, config, views)
        ours = answer["ranks"][rank]["layers"]
        if [layer["layer_name"] for layer in ours] != model.layers or sorted(theirs) != sorted(
            model.layers
        ):
            differences.append(f"{model.path.name} TP {tp} rank {rank}: layer lists differ")
            continue
        for layer in ours:
            name = layer["layer_name"]
            where = f"{model.path.name} TP {tp} rank {rank} layer {name}"
            diff = layer_difference(where, theirs[name], layer)
            compared += 1
            if diff:
                differences.append(diff)
        for layer in (ours[0], ours[-1]):
            if layer["kind"] != "certified":
                continue
            wrong, total = misplaced(model, tp, rank, layer["layer_name"], layer["runs"], views,
                                     tp1_views)
            if wrong:
                differences.append(
                    f"{model.path.name} TP {tp} rank {rank} {layer['layer_name']}: {wrong} of "
                    f"{total} bytes land elsewhere than vLLM's views say"
                )
    return compared, differences
