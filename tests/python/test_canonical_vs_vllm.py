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

import json
import os
import re
import subprocess
import sys

import pytest

import harness
import vllm_canonical as vc

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


def first_difference(model, tp, rank, layer, vllm_m, kvtier_layer):
    return vc.layer_difference(f"{model.path.name} TP {tp} rank {rank} layer {layer}", vllm_m,
                               kvtier_layer)


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
def test_runs_writers_page_sizes_and_bytes_equal_vllms(model):
    """Every rank's and layer's mapping equals vLLM's; on the first and last layer the byte
    oracle finds every byte where the views say (``vllm_canonical.compare``)."""
    total = 0
    for tp, answer in kvtier_by_tp(model, model.allowed_tps()).items():
        assert "error" not in answer, answer
        compared, differences = vc.compare(model, tp, answer)
        assert not differences, "\n".join(differences[:5])
        total += compared
    assert total == len(model.layers) * sum(model.allowed_tps())


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
            wrong, n = vc.misplaced(model, tp, rank, layer["layer_name"], layer["runs"],
                                 local_views, tp1_views)
            right, total = right + n - wrong, total + n
        assert right * shards == total, (model.path.name, tp, right, total)
        if shards > 1:
            layer = answer["ranks"][0]["layers"][0]
            vllm_m = vc.mappings(model, tp, 0, views=local_views)[layer["layer_name"]]
            assert first_difference(split, tp, 0, layer["layer_name"], vllm_m, layer)


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_kvtier_derives_the_page_from_vllms_views(model):
    """Given the views vLLM's allocator creates, kvtier derives the page encoding from their
    shapes and strides: the shipped descriptors are confirmed, the split descriptions
    refused with an error naming the layer and what the tensors hold."""
    queries, expect = [], []
    for tp in model.allowed_tps():
        views = vc.layer_views(model, tp)
        as_json = vc.views_json(model, views)
        queries.append({**query(model, tp), "views": as_json})
        expect.append((tp, True))
        if not model.mla:
            queries.append({**query(split_variant(model), tp), "views": as_json})
            expect.append((tp, False))
    for (tp, accepted), answer in zip(expect, ask_kvtier(queries)):
        where = f"{model.path.name} TP {tp}"
        if accepted:
            assert "error" not in answer, (where, answer)
            assert answer["page_encoding"] == {
                "kv_layout": model.d["kv_layout"],
                "kv_split": model.d.get("kv_split", "latent"),
                "source": "views",
            }, where
        else:
            assert answer.get("kind") == "incompatible_layout", (where, answer)
            assert f"layer 0 ({model.layers[0]})" in answer["error"], answer["error"]
            assert "holds a packed" in answer["error"], answer["error"]
            assert 'kv_split = "split"' in answer["error"], answer["error"]


def kvtier_cli(args, **env):
    return subprocess.run([harness.kvtier_bin(), *args], capture_output=True, text=True,
                          env={**os.environ, **env}, check=False)


def test_layout_check_runs_the_vllm_comparison(tmp_path, vllm_src):
    """`kvtier layout check` compares with vLLM's code when it can, fails a descriptor vLLM
    disagrees with, and says why when it cannot compare."""
    qwen = next(m for m in MODELS if m.path.stem == "qwen2.5-3b")
    llama = next(m for m in MODELS if m.path.stem == "llama-3.1-8b")
    (tmp_path / "qwen.toml").write_text(qwen.text)
    (tmp_path / "llama-split.toml").write_text(split_variant(llama).text)
    out = kvtier_cli(["layout", "check", str(tmp_path)], KVTIER_PYTHON=sys.executable,
                     KVTIER_VLLM_SRC=str(vllm_src))
    assert out.returncode == 2, out.stdout + out.stderr
    expected = len(qwen.layers) * 15 + len(llama.layers) * 15
    assert f"vLLM 0.33.0: {expected} layer mappings of 2 descriptors compared" in out.stdout, (
        out.stdout)
    fails = [line for line in out.stdout.splitlines() if line.startswith("FAIL  vLLM 0.33.0: ")]
    assert fails and all("llama-split.toml TP" in line for line in fails), out.stdout
    assert not any("llama-split.toml TP 1 " in line for line in fails), "TP 1 is one copy"
    (tmp_path / "llama-split.toml").unlink()
    out = kvtier_cli(["layout", "check", str(tmp_path)], KVTIER_PYTHON=sys.executable,
                     KVTIER_VLLM_SRC=str(vllm_src))
    assert out.returncode == 0 and ": 0 differ" in out.stdout, out.stdout
    out = kvtier_cli(["layout", "check", str(tmp_path)], KVTIER_VLLM_SRC=str(tmp_path / "none"))
    assert out.returncode == 0, out.stdout
    assert "vLLM 0.33.0 comparison skipped: KVTIER_VLLM_SRC=" in out.stdout, out.stdout


def test_layout_show_names_the_page_encoding_and_its_source(tmp_path):
    llama = next(m for m in MODELS if m.path.stem == "llama-3.1-8b")
    out = kvtier_cli(["layout", "show", str(llama.path), "--tp", "2", "--canonical"])
    assert out.returncode == 0, out.stderr
    assert "page        packed NHD (from the descriptor's kv_split and kv_layout" in out.stdout
    views = vc.layer_views(llama, 2)
    f = tmp_path / "views.json"
    f.write_text(json.dumps(vc.views_json(llama, views)))
    out = kvtier_cli(["layout", "show", str(llama.path), "--tp", "2", "--canonical",
                      "--views", str(f)])
    assert out.returncode == 0, out.stderr
    assert f"page        packed NHD (derived from the views in {f}" in out.stdout
    split = tmp_path / "split.toml"
    split.write_text(split_variant(llama).text)
    out = kvtier_cli(["layout", "show", str(split), "--tp", "2", "--views", str(f)])
    assert out.returncode != 0
    assert "holds a packed NHD page" in out.stdout + out.stderr


def vllm_engine_spec(model, tp, *, canonical, bpc):
    """What a vLLM engine of ``model`` presents to kvtier: vLLM's ``build_offloading_config``
    and ``TieringOffloadingSpec`` (its CPU spec sizes the row), read by ``kvtier.vllm``'s
    ``spec_fields`` as the Python tier reads them."""
    from kvtier.vllm import spec_fields
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    config = build_offloading_config(
        vc.vllm_config(model, tp, 0, canonical=canonical, bpc=bpc), vc.kv_cache_config(model, tp)
    )
    config.extra_config["cpu_bytes_to_use"] = 1 << 30
    spec = TieringOffloadingSpec(config)
    return spec_fields(spec, spec.kv_bytes_per_chunk)


@pytest.mark.parametrize("model", MODELS, ids=IDS)
@pytest.mark.parametrize("bpc", [1, 4])
@pytest.mark.parametrize("canonical", [True, False], ids=["canonical", "direct"])
def test_the_node_services_namespace_is_the_one_vllm_engines_present(model, bpc, canonical):
    """``kvtier serve --layout --tp`` (``VllmSpecFields::of_engine``) against vLLM's own spec
    of the same model and configuration: every field, and so the digest engines present."""
    from kvtier import _native

    for tp, answer in kvtier_by_tp(model, model.allowed_tps(), canonical=canonical,
                                   bpc=bpc).items():
        assert "error" not in answer, answer
        where = f"{model.path.name} TP {tp} bpc {bpc} canonical {canonical}"
        fields = vllm_engine_spec(model, tp, canonical=canonical, bpc=bpc)
        assert answer["engine_spec_fields"] == fields, where
        assert answer["engine_namespace"] == _native.namespace_of(json.dumps(fields))[1], where


def test_kvtier_serve_runs_the_namespace_vllm_engines_present(tmp_path):
    """The binary: ``kvtier serve --layout --tp 2`` with a service section reports (``kvtier
    service status``) the digest vLLM's spec of that model at TP 2 gives."""
    from kvtier import _native

    kvtier_bin = os.environ.get("KVTIER_BIN")
    if not kvtier_bin:
        pytest.skip("KVTIER_BIN is not set (run through cli/tests/python_suite.rs)")
    model = next(m for m in MODELS if m.path.stem == "llama-3.1-8b")
    socket = tmp_path / "kvtier.sock"
    (tmp_path / "slabs").mkdir()
    cfg = tmp_path / "kvtier.json"
    cfg.write_text(json.dumps({
        "cpu_bytes_to_use": "64MiB",
        "service": {"socket_path": str(socket)},
        "secondary_tiers": [{"type": "nvme", "paths": [str(tmp_path / "slabs")],
                             "capacity_bytes": "32MiB", "direct_io": "auto"}],
    }))
    serve = subprocess.Popen(
        [kvtier_bin, "serve", "--config", str(cfg), "--layout", str(model.path), "--tp", "2",
         "--metrics-addr", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        import time

        deadline = time.monotonic() + 60
        while not socket.exists():
            assert serve.poll() is None, serve.stderr.read()
            assert time.monotonic() < deadline, "the service never listened"
            time.sleep(0.02)
        status = json.loads(subprocess.run(
            [kvtier_bin, "service", "status", "--socket", str(socket), "--json"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout)
    finally:
        serve.terminate()
        serve.wait(timeout=60)
    fields = vllm_engine_spec(model, 2, canonical=False, bpc=1)
    assert status["digest"] == _native.namespace_of(json.dumps(fields))[1], status
    assert status["row_stride"] == fields["row_stride"], status


def hnd_variant(model):
    return vc.Model(model.path, model.text.replace('kv_layout = "NHD"', 'kv_layout = "HND"'))


@pytest.mark.parametrize("model", MODELS, ids=IDS)
def test_the_tensors_kvtier_allocates_are_the_views_vllms_allocator_creates(model, tmp_path):
    """Where kvtier gathers from tensors it allocates itself (``kvtier bench``, ``--gds``), it
    shapes them as vLLM's allocator does and derives the page encoding from them: kvtier's
    views (``kvtier layout show --allocate --json``) equal vLLM's ``create_kv_cache_views``
    (shape and strides, NHD and HND) at every TP size, and a split description is refused on
    that path, naming the layer and what the tensors hold."""
    variants = [model] if model.mla else [model, hnd_variant(model)]
    for variant in variants:
        f = tmp_path / f"{model.path.stem}-{variant.layout.name}.toml"
        f.write_text(variant.text)
        for tp in variant.allowed_tps():
            out = kvtier_cli(["layout", "show", str(f), "--tp", str(tp), "--canonical",
                              "--allocate", "--json"])
            assert out.returncode == 0, out.stderr
            report = json.loads(out.stdout)
            assert report["page_encoding"]["source"] == "allocated", report["page_encoding"]
            vllm = vc.layer_views(variant, tp, vc.kv_cache_config(variant, tp, num_blocks=1))
            want = [{"shape": list(vllm[n].shape), "stride": list(vllm[n].stride()),
                     "element_size": vllm[n].element_size()} for n in variant.layers]
            assert report["allocated_views"] == want, (f.name, tp)
    if model.mla:
        return
    split = tmp_path / "split.toml"
    split.write_text(split_variant(model).text)
    out = kvtier_cli(["layout", "show", str(split), "--tp", "1", "--allocate"])
    assert out.returncode != 0, out.stdout
    assert f"layer 0 ({model.layers[0]})" in out.stderr and "holds a packed" in out.stderr, \
        out.stderr
    text = kvtier_cli(["layout", "show", str(model.path), "--tp", "1", "--allocate"]).stdout
    assert "(derived from the layer tensors kvtier allocates as vLLM 0.33's allocator" in text


def test_kvtier_bench_refuses_a_descriptor_its_tensors_contradict(tmp_path):
    """``kvtier bench`` sizes and (with ``--gds``) gathers pages from tensors shaped as vLLM
    allocates them; a descriptor claiming the split encoding is refused before anything runs,
    and the shipped one runs, saying where its page encoding came from."""
    llama = next(m for m in MODELS if m.path.stem == "llama-3.1-8b")
    split = tmp_path / "split.toml"
    split.write_text(split_variant(llama).text)
    (tmp_path / "t").mkdir()
    args = ["bench", "--path", str(tmp_path / "t"), "--tp", "2", "--bytes", "8MiB",
            "--rounds", "1"]
    out = kvtier_cli([*args, "--layout", str(split)])
    assert out.returncode != 0, out.stdout
    assert "holds a packed NHD page" in out.stderr and 'kv_split = "split"' in out.stderr, \
        out.stderr
    assert not any((tmp_path / "t").iterdir()), "nothing was written for a refused layout"
    out = kvtier_cli([*args, "--layout", str(llama.path)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "packed NHD pages from the tensors as vLLM allocates them" in out.stdout, out.stdout
