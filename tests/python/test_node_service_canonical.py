"""One pool for every TP size through the node service: replicated GQA (Qwen2.5-3B) and the
namespace ``kvtier tier format`` writes.

Qwen2.5-3B has 2 KV heads: at TP 4 and 8 vLLM sizes the primary row for one copy per worker,
2 and 4 times the canonical area its workers fill. A ``KvtierTier`` whose entry names the
``layout`` presents the namespace of the canonical area, the same at every TP size; the node
service (``kvtier serve`` with a ``service`` section, the binary) serves that namespace and
takes engines whose rows hold its slot, each with its own row stride, and ``kvtier tier format``
writes it by default. The engines are vLLM 0.33's own ``build_offloading_config``, spec,
factory and manager, with vLLM's worker copy plans moving each rank's KV between "GPU" and row
(``test_kvtier_vllm_canonical.Deployment``); engine B runs in a second process
(``python test_node_service_canonical.py CHILD_JSON``, :func:`child_main`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # engine B's process: the harness set-up first
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import conftest  # noqa: F401  (stand-ins, clock, vLLM on sys.path)

import numpy as np
import pytest

import harness
import vllm_canonical as vc
from kvtier_engine import key
from test_kvtier_vllm_canonical import (  # noqa: F401  (deployments: a pytest fixture)
    BPC, QWEN, QWEN_AREA, Deployment, deployments, offloading)
from vllm.v1.kv_offload.base import LookupResult

LLAMA = vc.Model(harness.repo_root() / "layouts" / "llama-3.1-8b.toml")
#: What the service's pool holds: 16 MiB (14 slots of Qwen's area, 4 of Llama's at 2 blocks).
CAPACITY = "16MiB"
#: A byte vLLM never writes: what engine B's rows hold before its loads.
UNTOUCHED = 0x5A


def client_entry(socket, **keys) -> dict:
    entry = {"type": "KvtierTier", "module_path": "kvtier.vllm", "locality": "LOCAL",
             "service_socket_path": str(socket)}
    entry.update(keys)
    return entry


def kvtier(args, check=False) -> subprocess.CompletedProcess:
    binary = os.environ.get("KVTIER_BIN")
    if not binary:
        pytest.skip("KVTIER_BIN is not set (run through cli/tests/python_suite.rs)")
    out = subprocess.run([binary, *args], capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL)
    if check:
        assert out.returncode == 0, (args, out.stdout, out.stderr)
    return out


class Node:
    """A ``kvtier serve`` configuration for ``model`` at ``tp`` (canonical layout,
    :data:`BPC` blocks per chunk): the node service's (``service``) and an in-process one over
    the same pool."""

    def __init__(self, tmp_path, model, tp):
        self.model, self.tp = model, tp
        self.socket = tmp_path / "kvtier.sock"
        self.slabs = tmp_path / "slabs"
        self.slabs.mkdir()
        tier = {"type": "nvme", "paths": [str(self.slabs)], "capacity_bytes": CAPACITY,
                "direct_io": "auto"}
        common = {"cpu_bytes_to_use": "16MiB", "blocks_per_chunk": BPC,
                  "canonical_layout": True, "secondary_tiers": [tier]}
        self.node_config = tmp_path / "node.json"
        self.node_config.write_text(json.dumps(
            {**common, "service": {"socket_path": str(self.socket)}}))
        self.in_process_config = tmp_path / "in-process.json"
        self.in_process_config.write_text(json.dumps(common))
        self.proc = None

    def serve_args(self, config):
        return ["serve", "--config", str(config), "--layout", str(self.model.path),
                "--tp", str(self.tp), "--metrics-addr", "127.0.0.1:0"]

    def format(self, *extra) -> dict:
        """``kvtier tier format`` of the pool for the model, named as a shipped layout
        (``--layout qwen2.5-3b``; the service gets the descriptor file), ``extra``: more flags."""
        out = kvtier(["tier", "format", str(self.slabs), "--capacity", CAPACITY, "--layout",
                      self.model.path.stem, "--tp", str(self.tp), "--blocks-per-chunk",
                      str(BPC), "--canonical", "--direct-io", "auto", "--yes", "--json",
                      *extra], check=True)
        return json.loads(out.stdout)

    def start(self) -> dict:
        """Starts the node service; its status once it listens."""
        binary = os.environ.get("KVTIER_BIN") or pytest.skip("KVTIER_BIN is not set")
        self.proc = subprocess.Popen([binary, *self.serve_args(self.node_config)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        deadline = time.monotonic() + 60
        while not self.socket.exists():
            assert self.proc.poll() is None, self.proc.stderr.read()
            assert time.monotonic() < deadline, "the service never listened"
            time.sleep(0.02)
        return self.status()

    def status(self) -> dict:
        out = kvtier(["service", "status", "--socket", str(self.socket), "--json"], check=True)
        return json.loads(out.stdout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)
        self.proc = None

    def refusal(self, config) -> str:
        """``kvtier serve`` on ``config``, which must refuse the pool (exit 2); its stderr."""
        out = kvtier(self.serve_args(config))
        if out.returncode == 0 or out.returncode is None:
            pytest.fail(f"serve did not refuse the pool: {out.stdout} {out.stderr}")
        assert out.returncode == 2, out.stderr
        return out.stderr


def superblock_namespace(report: dict) -> str:
    (namespace,) = {f["superblock"]["namespace"] for f in report["files"]}
    return namespace


def format_command_in(message: str) -> list[str]:
    """The ``kvtier tier format`` command a refusal names (between backticks)."""
    (command,) = re.findall(r"`(kvtier tier format [^`]*)`", message)
    words = command.split()
    assert words[:3] == ["kvtier", "tier", "format"], command
    return words[1:]


@pytest.fixture
def nodes():
    started = []
    yield started
    for n in started:
        n.stop()


def deploy(opened, model, tp, tier):
    d = Deployment(model, tp, tier, engine_id=harness.engine_id("nodegqa"))
    opened.append(d)
    return d


def test_a_pool_formatted_for_the_layout_is_opened_by_the_node_service_and_vllm_engines(
        tmp_path, nodes, deployments):
    """``kvtier tier format --layout qwen2.5-3b --tp 4 --canonical`` (the default ``--for
    vllm``) writes the namespace the node service serves and TP 4 and TP 8 engines with the
    entry's ``layout`` present; the in-process serve refuses that pool naming the format
    command for it, that command works, and the node service then refuses the pool naming the
    command that works for it."""
    node = Node(tmp_path, QWEN, 4)
    nodes.append(node)
    formatted = node.format()
    assert formatted["namespace_for"] == "vllm"
    status = node.start()
    assert status["digest"] == superblock_namespace(formatted), status
    assert status["slot_bytes"] == QWEN_AREA, status
    for tp in (4, 8):
        d = deploy(deployments, QWEN, tp, client_entry(node.socket, layout="qwen2.5-3b"))
        assert d.engine.tier().namespace == status["digest"], tp
        assert d.engine.row == QWEN_AREA * tp // 2
        d.shutdown()
        deployments.remove(d)
    node.stop()

    # kvtier's in-process serve keeps the descriptor namespace: it refuses the pool and names
    # the command that formats one it opens.
    message = node.refusal(node.in_process_config)
    assert "--for in-process" in message, message
    kvtier([*format_command_in(message), "--yes"], check=True)
    inspected = json.loads(kvtier(["tier", "inspect", str(node.slabs), "--json"],
                                  check=True).stdout)
    assert superblock_namespace(inspected) != status["digest"]
    binary = os.environ["KVTIER_BIN"]
    serve = subprocess.Popen([binary, *node.serve_args(node.in_process_config)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = serve.stdout.readline()  # the endpoint's address, once the tiers are open
        assert first.strip(), serve.stderr.read()
    finally:
        serve.terminate()
        assert serve.wait(timeout=60) == 0, serve.stderr.read()

    # The node service refuses that pool in turn, naming the command that works for it.
    message = node.refusal(node.node_config)
    assert "--for vllm" in message, message
    assert status["digest"] in message, message
    kvtier([*format_command_in(message), "--yes"], check=True)
    assert node.start()["digest"] == status["digest"]


def test_tp_4_and_tp_8_engines_share_one_pool_through_the_service_byte_exact(
        tmp_path, nodes, deployments):
    """Engine A (TP 4, rows of twice the area) stores through the service; engine B (TP 8,
    rows of four times the area, another process) loads it: every rank's KV byte-exact, and
    only the area of B's row written. B stores, A loads the same way."""
    node = Node(tmp_path, QWEN, 4)
    nodes.append(node)
    node.format()
    digest = node.start()["digest"]
    entry = client_entry(node.socket, layout="qwen2.5-3b")
    a = deploy(deployments, QWEN, 4, entry)
    assert a.engine.row == 2 * QWEN_AREA
    start, end, row = a.store(key(4), chunk=4)
    assert (start, end) == (0, QWEN_AREA)
    assert (row[end:] == 0xA5).all(), "vLLM wrote past the canonical area"

    child = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()),
         json.dumps({"tp": 8, "entry": entry, "load": key(4).hex(), "load_chunk": 4,
                     "store": key(8).hex(), "store_chunk": 8})],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["namespace"] == digest, report
    assert report["row"] == 4 * QWEN_AREA, report
    assert report["first"] in ("HIT", "HIT_PENDING") and report["last"] == "HIT", report
    assert report["ranks_equal"] == [True] * 8, report
    assert report["past_area_untouched"] is True, report
    assert report["stored_area"] == [0, QWEN_AREA], report

    got = a.load(key(8))
    for rank, buf in enumerate(got):
        want = a.expected(rank, chunk=8)
        assert (buf == want).all(), f"stored at TP 8, loaded at TP 4 rank {rank}"
    status = node.status()
    assert status["tier"]["used_slots"] == 2, status
    (engine,) = status["engines"]
    assert engine["region"]["row_stride"] == 2 * QWEN_AREA, engine


def test_an_engine_without_the_layout_key_is_refused_with_both_digests_and_a_hint(
        tmp_path, nodes):
    """Qwen2.5-3B at TP 4 without ``layout`` presents its whole row, not the pool's area."""
    import kvtier
    from kvtier import _native
    from kvtier.vllm import spec_fields
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    node = Node(tmp_path, QWEN, 4)
    nodes.append(node)
    node.format()
    digest = node.start()["digest"]
    entry = client_entry(node.socket)
    engine_id = harness.engine_id("nodegqa")
    spec = TieringOffloadingSpec(offloading(QWEN, 4, entry, engine_id))
    assert spec.kv_bytes_per_chunk == 2 * QWEN_AREA
    engines_digest = _native.namespace_of(json.dumps(spec_fields(spec, spec.kv_bytes_per_chunk)))[1]
    assert engines_digest != digest
    try:
        with pytest.raises(kvtier.ConfigError) as err:
            Deployment(QWEN, 4, entry, engine_id=engine_id)
    finally:
        # The manager never came up: vLLM's region file is ours to remove.
        Path(f"/dev/shm/vllm_offload_{engine_id}.mmap").unlink(missing_ok=True)
    message = str(err.value)
    assert "compatibility digest mismatch" in message, message
    assert digest in message and engines_digest in message, message
    assert f"rows ({2 * QWEN_AREA} bytes)" in message, message
    assert f"slots ({QWEN_AREA} bytes)" in message, message
    assert "set the tier entry's layout key" in message, message
    assert node.status()["engines"] == []


def test_a_model_whose_area_is_the_row_connects_with_or_without_the_layout_key(
        tmp_path, nodes, deployments):
    """Llama-3.1-8B at TP 2: the canonical area is the row, so both namespaces are one."""
    node = Node(tmp_path, LLAMA, 2)
    nodes.append(node)
    node.format()
    digest = node.start()["digest"]
    for keys in ({}, {"layout": "llama-3.1-8b"}):
        d = deploy(deployments, LLAMA, 2, client_entry(node.socket, **keys))
        assert d.engine.tier().namespace == digest, keys
        assert int(d.engine.tier().config_info()["kvtier_slot_bytes"]) == d.engine.row
        d.shutdown()
        deployments.remove(d)


def child_main(argv) -> None:
    """Engine B: a vLLM deployment at ``tp`` over the service; loads ``load`` (chunk
    ``load_chunk``'s KV) into rows that hold :data:`UNTOUCHED`, checks every rank's KV and
    the row past the area, then stores ``store`` (chunk ``store_chunk``)."""
    args = json.loads(argv[0])
    d = Deployment(QWEN, args["tp"], args["entry"], engine_id=harness.engine_id("nodegqa"))
    try:
        report = {"namespace": d.engine.tier().namespace, "row": d.engine.row}
        d._region[:] = UNTOUCHED
        k = bytes.fromhex(args["load"])
        m = d.engine.manager
        req = d.engine.request()
        outcome = d.engine.promote([k], req)
        report["first"], report["last"] = (r.name for r in outcome[k])
        if outcome[k][1] is LookupResult.HIT:
            spec = m.prepare_load([k], req)
            (cid,) = [int(c) for c in spec.chunk_ids]
            row = d.row(cid)
            report["past_area_untouched"] = bool((row[QWEN_AREA:] == UNTOUCHED).all())
            equal = []
            for rank in range(d.tp):
                gpu = np.zeros(d.config.kv_cache_tensors[0].size, dtype=np.uint8)
                d.worker(rank, gpu).load(cid)
                equal.append(bool((gpu == d.expected(rank, args["load_chunk"])).all()))
            report["ranks_equal"] = equal
            m.complete_load([k], req)
        d.engine.finish(req)
        start, end, _ = d.store(bytes.fromhex(args["store"]), chunk=args["store_chunk"])
        report["stored_area"] = [int(start), int(end)]
    finally:
        d.shutdown()
    print(json.dumps(report))


if __name__ == "__main__":
    child_main(sys.argv[1:])
