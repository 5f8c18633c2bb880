"""kvtier's canonical layout against vLLM 0.33.0's own canonical-mapping code.

For every descriptor in ``layouts/``, every TP size of 1/2/4/8 the model allows and every rank:

* vLLM's side: the per-layer views vLLM's allocator creates (``create_kv_cache_views`` over a
  metadata-only buffer, strides from ``compute_layout_strides``), fed to vLLM's own
  ``derive_canonical_mappings``; the digest from ``build_offloading_config`` and
  ``FileMapper.from_offloading_spec`` (``vllm_canonical.py``);
* kvtier's side: ``kvtier-replay canonical`` on the same descriptor file;
* compared run for run (kvtier's runs coalesced by vLLM's ``_coalesce_runs``), with page
  sizes, writer election, portability and digests;
* and a byte oracle that uses neither implementation: from the views' strides alone, where
  each byte of a rank's page truly belongs in the TP-1 page; kvtier's runs must put every byte
  there.

``test_the_oracle_refuses_the_split_description`` shows the comparison can fail: the same
descriptors declared ``kv_split = "split"`` (what ``layouts/`` said before issue 13) put only
``1 / shards`` of each layer's bytes at their canonical place at TP > 1 (the comparisons
above fail on them: 21 of the tests here, checked by running this file on ``layouts/`` before
the fix).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import harness
import vllm_canonical as vc
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
    _coalesce_runs,
)
from vllm.v1.kv_offload.base import CopyRun

LAYOUT_DIR = harness.repo_root() / "layouts"
MODELS = [vc.Model(p) for p in sorted(LAYOUT_DIR.glob("*.toml"))]
IDS = [m.path.stem for m in MODELS]


def ask_kvtier(queries):
    return harness.replay("canonical", {"queries": queries})["results"]


def query(model, tp, *, canonical=True, bpc=1):
    if model.text == model.path.read_text():
        return {"layout": str(model.path), "tp": tp, "canonical": canonical, "blocks_per_chunk": bpc}
    return {"layout_toml": model.text, "tp": tp, "canonical": canonical, "blocks_per_chunk": bpc}


def kvtier_by_tp(model, tps=vc.TPS, **kw):
    results = ask_kvtier([query(model, tp, **kw) for tp in tps])
    return dict(zip(tps, results))


def coalesced(runs):
    return _coalesce_runs([CopyRun(**r) for r in runs])


def first_difference(model, tp, rank, layer, vllm_m, kvtier_layer):
    where = f"{model.path.name} TP {tp} rank {rank} layer {layer}"
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


def test_every_shipped_descriptor_is_compared():
    assert len(MODELS) >= 8, [m.path.name for m in MODELS]
    by_kind = {m.d["attention"] for m in MODELS}
    assert by_kind == {"mha", "gqa", "mla"}
    # kvtier allows exactly the TP sizes the model allows (the others are refused).
    for model in MODELS:
        answers = kvtier_by_tp(model)
        allowed = [tp for tp, a in answers.items() if "error" not in a]
        assert allowed == model.allowed_tps(), (model.path.name, answers)


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_runs_writers_and_page_sizes_equal_vllms(model):
    answers = kvtier_by_tp(model, model.allowed_tps())
    compared = 0
    for tp, answer in answers.items():
        assert "error" not in answer, answer
        config = vc.kv_cache_config(model, tp)
        views = vc.layer_views(model, tp, config)
        for rank in range(tp):
            theirs = vc.mappings(model, tp, rank, config, views)
            assert sorted(theirs) == sorted(model.layers), "vLLM maps every layer"
            ours = answer["ranks"][rank]["layers"]
            assert [layer["layer_name"] for layer in ours] == model.layers
            for layer in ours:
                diff = first_difference(model, tp, rank, layer["layer_name"],
                                        theirs[layer["layer_name"]], layer)
                assert diff is None, diff
                compared += 1
    assert compared == len(model.layers) * sum(model.allowed_tps())


def misplaced(model, tp, rank, layer, runs, local_views, tp1_views):
    truth = vc.oracle(model, tp, rank, layer, local_views, tp1_views)
    placed = vc.place(runs, truth.size)
    return int(np.count_nonzero(placed != truth)), truth.size


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_kvtier_puts_every_byte_where_the_views_say(model):
    tp1_views = vc.layer_views(model, 1)
    for tp, answer in kvtier_by_tp(model, model.allowed_tps()).items():
        local_views = vc.layer_views(model, tp)
        for rank in range(tp):
            layers = answer["ranks"][rank]["layers"]
            for layer in (layers[0], layers[-1]):
                name = layer["layer_name"]
                wrong, total = misplaced(model, tp, rank, name, layer["runs"], local_views,
                                         tp1_views)
                assert wrong == 0, (
                    f"{model.path.name} TP {tp} rank {rank} {name}: {wrong} of {total} bytes "
                    f"land elsewhere than the views say"
                )


@pytest.mark.parametrize("model", MODELS, ids=IDS)
@pytest.mark.parametrize("bpc", [1, 4])
@pytest.mark.parametrize("canonical", [True, False], ids=["canonical", "direct"])
def test_vllm_digest_equals_vllm_file_mapper(model, bpc, canonical):
    for tp, answer in kvtier_by_tp(model, model.allowed_tps(), canonical=canonical,
                                   bpc=bpc).items():
        assert "error" not in answer, answer
        fm = vc.file_mapper(model, tp, canonical=canonical, bpc=bpc)
        where = f"{model.path.name} TP {tp} bpc {bpc} canonical {canonical}"
        assert answer["vllm_digest_fields"] == fm.fields, where
        assert fm.base_path.endswith("_" + answer["vllm_digest"]), (where, fm.base_path)


def split_variant(model):
    text, n = re.subn(r'(?m)^kv_split = "packed"$', 'kv_split = "split"', model.text)
    assert n == 1, f"{model.path.name} declares no packed page"
    return vc.Model(model.path, text)


ATTENTION = [m for m in MODELS if not m.mla]


@pytest.mark.parametrize("model", ATTENTION, ids=[m.path.stem for m in ATTENTION])
def test_the_oracle_refuses_the_split_description(model):
    """The descriptions layouts/ shipped before issue 13 (kv_split = "split") disagree with the
    views vLLM allocates: at TP > 1 only one byte in `shards` (over all ranks) keeps its place
    (50 % / 25 % / 12.5 % at TP 2 / 4 / 8), and vLLM's runs and kvtier's differ."""
    split = split_variant(model)
    tp1_views = vc.layer_views(model, 1)
    for tp, answer in kvtier_by_tp(split, model.allowed_tps()).items():
        local_views = vc.layer_views(model, tp)
        shards = min(tp, model.kv_heads)
        right = total = 0
        for rank in range(tp):
            layer = answer["ranks"][rank]["layers"][0]
            wrong, n = misplaced(model, tp, rank, layer["layer_name"], layer["runs"],
                                 local_views, tp1_views)
            right, total = right + n - wrong, total + n
        assert right * shards == total, (model.path.name, tp, right, total)
        if shards > 1:
            layer = answer["ranks"][0]["layers"][0]
            vllm_m = vc.mappings(model, tp, 0, views=local_views)[layer["layer_name"]]
            assert first_difference(split, tp, 0, layer["layer_name"], vllm_m, layer)
