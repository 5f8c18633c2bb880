"""kvtier as vLLM 0.33.0's tier for the canonical layout across TP sizes, with replicated GQA.

Qwen2.5-3B has 2 KV heads: at TP 4 and 8 vLLM replicates them (2 and 4 ranks per head) and
sizes the primary row for one copy per worker, 2 and 4 times the canonical area its workers
fill. vLLM gives a secondary tier no KV head count; the entry's ``layout`` key names the
descriptor, kvtier checks it against vLLM's configuration and stores only the canonical area,
under one namespace at every TP size.

Everything around kvtier is vLLM's code: the ``OffloadingConfig`` comes from vLLM's
``build_offloading_config`` for the model at each TP size (``vllm_canonical``); the tier is
built by vLLM's ``TieringOffloadingSpec`` / ``SecondaryTierFactory`` / manager
(``kvtier_engine.Engine``); each rank's KV is written through the views vLLM's allocator
creates, and moved between the "GPU" and the primary row by vLLM's own worker copy plans
(``vllm_worker.CanonicalWorker``: ``derive_canonical_mappings``, ``create_next_canonical_view``,
``_fill_canonical_ops`` with its writer rotation). The test checks that vLLM's workers fill
exactly a prefix of the row, and that what one TP size stored loads byte-exact into every rank
at every other TP size.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re

import numpy as np
import pytest

import harness
import vllm_canonical as vc
import vllm_worker as vw
from kvtier_engine import Engine, key
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
)
from vllm.v1.kv_offload.base import LookupResult

QWEN = vc.Model(harness.repo_root() / "layouts" / "qwen2.5-3b.toml")
BPC = 2  # two canonical pages per chunk: the writer rotation alternates between them
PRIMARY_ROWS = 3
SLOTS = 8

_ids = itertools.count()


def entry(path, **keys):
    e = {"type": "KvtierTier", "module_path": "kvtier.vllm", "locality": "LOCAL",
         "paths": [str(path)], "capacity_bytes": SLOTS * QWEN_AREA}
    e.update(keys)
    return e


#: The canonical area of a Qwen2.5-3B chunk: 36 layers x 16 tokens x 2 KV heads x 128 x
#: (K and V) x 2 bytes per block.
QWEN_AREA = 36 * 16 * 2 * 128 * 2 * 2 * BPC


def offloading(model, tp, tier, engine_id=None):
    """vLLM's own ``OffloadingConfig`` for ``model`` at ``tp`` with ``tier`` as its one
    secondary tier (canonical layout on); ``engine_id`` names the engine (its region file)."""
    row_guess = 4 * QWEN_AREA  # the primary's size only; vLLM sizes the rows
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": PRIMARY_ROWS * row_guess,
             "secondary_tiers": [tier]}
    config = build_offloading_config(
        vc.vllm_config(model, tp, 0, canonical=True, bpc=BPC, extra=extra),
        vc.kv_cache_config(model, tp, num_blocks=BPC),
    )
    return dataclasses.replace(
        config, engine_id=engine_id or f"kvtier-gqa-{os.getpid()}-{next(_ids)}")


class Deployment:
    """vLLM at one TP size over kvtier: the scheduler's manager and every rank's worker."""

    def __init__(self, model, tp, tier, engine_id=None):
        self.model, self.tp = model, tp
        self.engine = Engine({}, offloading=offloading(model, tp, tier, engine_id))
        self.config = vc.kv_cache_config(model, tp, num_blocks=BPC)
        self.views = vc.layer_views(model, tp, self.config)
        flat = self.engine.view.cast("B")
        self._region = np.frombuffer(flat, dtype=np.uint8)
        self._flat = flat
        self.num_chunks = self._region.size // self.engine.row

    def worker(self, rank, gpu):
        return vw.CanonicalWorker(self.model, self.tp, rank, BPC, self.config, self.views, gpu,
                                  self._region.ctypes.data, self.engine.row, self.num_chunks)

    def expected(self, rank, chunk):
        return vw.rank_buffer(self.model, self.tp, rank, self.config, self.views, chunk * BPC)

    def row(self, chunk_id):
        r = self.engine.row
        return self._region[chunk_id * r:(chunk_id + 1) * r]

    def store(self, k, chunk):
        """The scheduler stores chunk ``k``: every rank's worker copies its KV (model blocks of
        ``chunk``) into the row vLLM hands out; then vLLM cascades it to kvtier."""
        m = self.engine.manager
        req = self.engine.request()
        out = m.prepare_store([k], req)
        assert out is not None and list(out.keys_to_store) == [k]
        (cid,) = [int(c) for c in out.store_spec.chunk_ids]
        self.row(cid)[:] = 0xA5  # what the row held before: must stay outside the area
        areas = set()
        for rank in range(self.tp):
            w = self.worker(rank, self.expected(rank, chunk))
            w.store(cid)
            areas.add((w.canonical_areas[0][0], w.canonical_areas[-1][1]))
        m.complete_store([k], req, success=True)
        self.engine.settle()
        self.engine.finish(req)
        ((start, end),) = areas
        return start, end, self.row(cid).copy()

    def load(self, k):
        """The scheduler finds ``k`` in kvtier, promotes it and every rank's worker loads it;
        returns each rank's KV cache."""
        req = self.engine.request()
        outcome = self.engine.promote([k], req)
        assert outcome[k][1] is LookupResult.HIT, outcome
        m = self.engine.manager
        spec = m.prepare_load([k], req)
        (cid,) = [int(c) for c in spec.chunk_ids]
        got = []
        for rank in range(self.tp):
            gpu = np.zeros(self.config.kv_cache_tensors[0].size, dtype=np.uint8)
            self.worker(rank, gpu).load(cid)
            got.append(gpu)
        m.complete_load([k], req)
        self.engine.finish(req)
        return got

    def shutdown(self):
        del self._region
        self._flat.release()
        self.engine.shutdown()


@pytest.fixture
def deployments():
    opened = []
    yield opened
    for d in opened:
        try:
            d.shutdown()
        except Exception:
            pass


def deploy(opened, tp, tier):
    d = Deployment(QWEN, tp, tier)
    opened.append(d)
    return d


def test_replicated_gqa_stores_and_loads_byte_exact_at_every_tp_under_one_namespace(
        tmp_path, deployments):
    tier = entry(tmp_path / "g3", layout="qwen2.5-3b")
    (tmp_path / "g3").mkdir()
    tps = QWEN.allowed_tps()
    assert tps == [1, 2, 4, 8]
    rows, namespaces, slots = {}, set(), set()
    for tp in tps:
        d = deploy(deployments, tp, tier)
        rows[tp] = d.engine.row
        info = d.engine.tier().config_info()
        namespaces.add(d.engine.tier().namespace)
        slots.add(int(info["kvtier_slot_bytes"]))
        start, end, row = d.store(key(tp), chunk=tp)
        # vLLM's workers fill exactly a prefix of the row: the canonical area kvtier stores.
        assert start == 0 and end == QWEN_AREA, (tp, start, end)
        assert (row[end:] == 0xA5).all(), f"TP {tp}: vLLM wrote past the canonical area"
        assert not (row[:end] == 0xA5).all()
        d.shutdown()
        deployments.remove(d)
    assert rows == {1: QWEN_AREA, 2: QWEN_AREA, 4: 2 * QWEN_AREA, 8: 4 * QWEN_AREA}, rows
    assert len(namespaces) == 1, namespaces
    assert slots == {QWEN_AREA}, slots

    for tp_load in tps:
        d = deploy(deployments, tp_load, tier)
        assert d.engine.tier().namespace in namespaces
        for tp_store in tps:
            got = d.load(key(tp_store))
            for rank, buf in enumerate(got):
                want = d.expected(rank, chunk=tp_store)
                assert (buf == want).all(), (
                    f"stored at TP {tp_store}, loaded at TP {tp_load} rank {rank}: "
                    f"{int((buf != want).sum())} of {want.size} bytes differ"
                )
        d.shutdown()
        deployments.remove(d)


def test_without_the_key_tp_4_keeps_its_own_namespace_as_documented(tmp_path, deployments):
    import kvtier

    (tmp_path / "g3").mkdir()
    tier = entry(tmp_path / "g3")
    d = deploy(deployments, 2, tier)
    ns_2 = d.engine.tier().namespace
    assert int(d.engine.tier().config_info()["kvtier_slot_bytes"]) == QWEN_AREA
    d.shutdown()
    deployments.remove(d)
    with pytest.raises(kvtier.ConfigError) as err:
        Deployment(QWEN, 4, tier)
    # Refused (slots of another size), never misread.
    message = str(err.value)
    assert "row_stride differs" in message, message
    assert f"expected: {2 * QWEN_AREA}, found: {QWEN_AREA}" in message, message
    # A tier directory of its own works at TP 4, with whole rows.
    (tmp_path / "g3-tp4").mkdir()
    d = deploy(deployments, 4, entry(tmp_path / "g3-tp4"))
    assert d.engine.tier().namespace != ns_2
    assert int(d.engine.tier().config_info()["kvtier_slot_bytes"]) == 2 * QWEN_AREA


def wrong_descriptor(tmp_path, **changes):
    text = QWEN.text
    for k, v in changes.items():
        text, n = re.subn(rf"(?m)^{k} = .*$", f"{k} = {v}", text)
        assert n == 1, k
    path = tmp_path / "wrong.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("tp, layout, expected, found", [
    # Another shipped model.
    (4, "qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-3B-Instruct"),
    # The model served under another name (a descriptor must say the name vLLM serves).
    (4, {"model_name": '"/models/qwen"'}, "/models/qwen", "Qwen/Qwen2.5-3B-Instruct"),
    # Twice the KV heads: a worker block at TP 2 is twice as large.
    (2, {"num_kv_heads": 4}, str(36 * 2 * 16 * 128 * 2 * 2), str(36 * 1 * 16 * 128 * 2 * 2)),
    # Another dtype, another layer count, another block size.
    (8, {"dtype": '"float16"'}, "float16", "bfloat16"),
    (4, {"num_layers": 28}, "28", "36"),
    (1, {"tokens_per_block": 32}, "32", "16"),
])
def test_a_wrong_layout_is_refused_naming_the_key_and_both_values(
        tmp_path, tp, layout, expected, found):
    import kvtier

    (tmp_path / "g3").mkdir()
    if isinstance(layout, dict):
        layout = wrong_descriptor(tmp_path, **layout)
    with pytest.raises(kvtier.ConfigError) as err:
        Deployment(QWEN, tp, entry(tmp_path / "g3", layout=layout))
    message = str(err.value)
    assert "secondary_tiers[0].layout" in message, message
    assert f"expected: {expected}" in message and f"found: {found}" in message, message
    assert not any((tmp_path / "g3").iterdir()), "nothing was created for a refused tier"


def test_the_layout_key_needs_vllms_canonical_layout(tmp_path):
    import kvtier

    (tmp_path / "g3").mkdir()
    tier = entry(tmp_path / "g3", layout="qwen2.5-3b")
    config = dataclasses.replace(offloading(QWEN, 2, tier), canonical_layout=False)
    with pytest.raises(kvtier.ConfigError) as err:
        Engine({}, offloading=config)
    message = str(err.value)
    assert "secondary_tiers[0].layout" in message and "canonical_layout" in message, message
