"""Bytes written through vLLM-shaped KV-cache views at one TP size load byte-exact at every
other TP size the model allows, through kvtier's canonical layout and a G3 tier.

For each model, the KV values of one chunk are a fixed function of (layer, block, model KV
head, token, element byte): what the model computes does not depend on TP. At each TP size,
every rank's KV cache is a real buffer of the size vLLM's planner gives it, and the values are
written into it **through the views vLLM's allocator creates** (``create_kv_cache_views``;
each rank's heads are the ones TP gives it). A rank's local chunk is then read out of that
buffer the way a worker's page is (``view[block]``, layer after layer). kvtier
(``kvtier-replay roundtrip``) gathers every rank's chunk into one row, stores it in a G3 tier
(vLLM's row size for the TP, slots of the canonical area, kvtier's namespace: nothing is
overridden), and at every TP size loads it back and scatters it into each rank's chunk, which
must equal that TP's chunk byte for byte. Replicated GQA (Qwen2.5-3B at TP 4 and 8, where
vLLM's row is 2 and 4 times the canonical area) runs at full size, the other models (MLA
DeepSeek-V3 included) with 3 layers: every layer's page has the same geometry, and the disk a
test may use stays small (under 50 MB at the peak: one TP size's loaded chunks at a time).
"""

from __future__ import annotations

import os
import re

import pytest

import harness
import vllm_canonical as vc
import vllm_worker as vw

LAYOUT_DIR = harness.repo_root() / "layouts"
FULL_SIZE = {"qwen2.5-3b"}
BPC = 2  # blocks per chunk: two canonical pages, so the writer election rotates


def model_for(path):
    text = path.read_text()
    if path.stem not in FULL_SIZE:
        text = re.sub(r"(?m)^num_layers = \d+$", "num_layers = 3", text)
    return vc.Model(path, text)


MODELS = [model_for(p) for p in sorted(LAYOUT_DIR.glob("*.toml"))]


def rank_chunks(model, tp, chunk):
    """Every rank's local chunk at `tp`, written through vLLM's views (``vllm_worker``)."""
    config = vc.kv_cache_config(model, tp, num_blocks=BPC)
    views = vc.layer_views(model, tp, config)
    chunks = []
    for rank in range(tp):
        buf = vw.rank_buffer(model, tp, rank, config, views, chunk * BPC)
        out = []
        for name in model.layers:
            v = views[name]
            _, heads, tokens, content = v.shape
            e = v.element_size()
            page = heads * tokens * content * e
            for blk in range(BPC):
                start = v[blk].storage_offset() * e
                out.append(buf[start:start + page].tobytes())
        chunks.append(b"".join(out))
    return views, chunks


@pytest.mark.parametrize("model", MODELS, ids=[m.path.stem for m in MODELS])
def test_stored_at_one_tp_loads_byte_exact_at_every_other(model, tmp_path):
    tps = model.allowed_tps()
    by_tp = {tp: rank_chunks(model, tp, chunk=tp) for tp in tps}
    dir_ = tmp_path / "g3"
    dir_.mkdir()

    def replay(steps):
        results = harness.replay("roundtrip", {
            "dir": str(dir_), "layout_toml": model.text, "blocks_per_chunk": BPC, "steps": steps,
        })["results"]
        for step, result in zip(steps, results):
            assert "error" not in result, (model.path.name, step["op"], step["tp"], result)
        return results

    steps = []
    for tp_store in tps:
        views, chunks = by_tp[tp_store]
        files = []
        for rank, data in enumerate(chunks):
            f = tmp_path / f"store-tp{tp_store}-r{rank}"
            f.write_bytes(data)
            files.append(str(f))
        steps.append({"op": "store", "tp": tp_store, "key": tp_store,
                      "views": vc.views_json(model, views), "files": files})
    results = replay(steps)
    for step in steps:
        for f in step["files"]:
            os.unlink(f)
    rows = {s["tp"]: r["row_stride"] for s, r in zip(steps, results)}
    for tp_load in tps:
        views, _ = by_tp[tp_load]
        steps, expected = [], []
        for tp_store in tps:
            # What tp_load's ranks hold for the chunk tp_store wrote (chunk id tp_store).
            _, want = rank_chunks(model, tp_load, chunk=tp_store)
            files = [str(tmp_path / f"load-tp{tp_load}-from{tp_store}-r{r}")
                     for r in range(tp_load)]
            steps.append({"op": "load", "tp": tp_load, "key": tp_store,
                          "views": vc.views_json(model, views), "files": files})
            expected.append((tp_store, files, want))
        results += replay(steps)
        for tp_store, files, want in expected:
            for rank, (f, w) in enumerate(zip(files, want)):
                with open(f, "rb") as fh:
                    got = fh.read()
                os.unlink(f)
                assert got == w, (
                    f"{model.path.name}: stored at TP {tp_store}, loaded at TP {tp_load} rank "
                    f"{rank}: {sum(a != b for a, b in zip(got, w))} of {len(w)} bytes differ"
                )
    namespaces = {r["namespace"] for r in results}
    assert len(namespaces) == 1, f"{model.path.name}: one namespace for every TP size"
    slots = {r["slot_bytes"] for r in results}
    assert len(slots) == 1, slots
    if model.path.stem == "qwen2.5-3b":
        assert rows[4] == 2 * rows[2] and rows[8] == 4 * rows[2], rows
        assert slots == {rows[1]}
