"""vLLM 0.33.0's own tiering stack over ``kvtier.vllm.KvtierTier``, for the contract tests.

:class:`Engine` builds vLLM's ``TieringOffloadingSpec`` from an ``OffloadingConfig``, and with
it vLLM's ``SecondaryTierFactory`` (which imports ``kvtier.vllm`` by ``module_path``), its CPU
primary manager over a real shared region, and its ``TieringOffloadingManager``. The test plays
the scheduler (requests, lookups, step ends) and the GPU worker (it writes a chunk's bytes into
the primary row vLLM hands out, as the GPU->CPU copy would). Everything between the test and
kvtier is vLLM's code.

Also run as a script by the restart test: ``python kvtier_engine.py CHILD_JSON`` opens the same
tier in a second process and reports what it finds (see :func:`child_main`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # the restart test's second process: the harness set-up first
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import conftest  # noqa: F401  (stand-ins, clock, vLLM on sys.path)

import harness
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

#: Bytes of one primary row (and kvtier slot) in these tests.
ROW = 4096
#: Rows of the primary region.
PRIMARY_ROWS = 8


def tier_entry(path, **keys) -> dict:
    """The ``secondary_tiers`` entry that loads kvtier (``docs/vllm.md``)."""
    entry = {
        "type": "KvtierTier",
        "module_path": "kvtier.vllm",
        "locality": "LOCAL",
        "paths": [str(path)],
        "capacity_bytes": 64 * ROW,
    }
    entry.update(keys)
    return entry


def extra_config(*tiers, **keys) -> dict:
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": PRIMARY_ROWS * ROW,
        "secondary_tiers": list(tiers),
    }
    extra.update(keys)
    return extra


def offloading_config(
    extra: dict,
    *,
    model: str = "kvtier/contract",
    tp: int = 1,
    canonical: bool = False,
    agnostic: bool = False,
    kv_cache_layout: str | None = "LBNHC",
    events: bool = False,
) -> OffloadingConfig:
    """vLLM's normalized config of a two-layer model whose row is :data:`ROW` bytes at any TP
    (each of ``tp`` workers holds ``ROW / tp`` bytes per block)."""
    return OffloadingConfig(
        groups=(
            OffloadingGroupConfig(
                tokens_per_block=16, layer_names=("layers.0", "layers.1"), group_id=0
            ),
        ),
        worker_kv_bytes_per_block=ROW // tp,
        enable_kv_cache_events=events,
        extra_config=extra,
        engine_id=harness.engine_id("contract"),
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=tp,
            tp_size=tp,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=agnostic,
        ),
        canonical_layout=canonical,
        kv_cache_layout=kv_cache_layout,
    )


def key(n: int) -> bytes:
    """A vLLM offload key: a 32-byte block hash and the big-endian group id 0."""
    return hashlib.sha256(f"block {n}".encode()).digest() + (0).to_bytes(4, "big")


def payload(k: bytes) -> bytes:
    """The row bytes of chunk ``k``: unique per key, so a row can be found in a slab file."""
    out = bytearray()
    seed = k
    while len(out) < ROW:
        seed = hashlib.sha256(seed).digest()
        out += seed
    return bytes(out[:ROW])


class Engine:
    """vLLM's spec and manager with kvtier as (one of) its secondary tiers."""

    def __init__(self, extra: dict, *, offloading: OffloadingConfig | None = None, **config):
        """``offloading``: an ``OffloadingConfig`` built elsewhere (vLLM's own
        ``build_offloading_config`` for a real model, ``vllm_canonical``), used as it is;
        otherwise :func:`offloading_config` of ``extra`` and ``config``."""
        if offloading is None:
            offloading = offloading_config(copy.deepcopy(extra), **config)
        self.spec = TieringOffloadingSpec(offloading)
        self.manager = self.spec.get_manager()
        self.view = self.manager.primary_tier.get_kv_memoryview()
        #: Bytes of one primary row (vLLM's ``strides[0]``).
        self.row = self.view.strides[0]
        self._requests = 0

    def tier(self, i: int = 0):
        return self.manager.secondary_tiers[i]

    # ---- the GPU worker's side ------------------------------------------------------------

    def write_row(self, chunk_id: int, data: bytes) -> None:
        with self.view.cast("B") as flat:
            flat[chunk_id * self.row : (chunk_id + 1) * self.row] = data

    def read_row(self, chunk_id: int) -> bytes:
        with self.view.cast("B") as flat:
            return flat[chunk_id * self.row : (chunk_id + 1) * self.row].tobytes()

    # ---- the scheduler's side -------------------------------------------------------------

    def request(self) -> ReqContext:
        self._requests += 1
        req = ReqContext(req_id=f"req-{self._requests}")
        self.manager.on_new_request(req)
        return req

    def store(self, keys, req) -> list:
        """prepare_store, the "GPU" writes each new row, complete_store (which cascades)."""
        out = self.manager.prepare_store(keys, req)
        assert out is not None, "the primary refused the store"
        for k, cid in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
            self.write_row(int(cid), payload(k))
        if out.keys_to_store:
            self.manager.complete_store(out.keys_to_store, req, success=True)
        return list(out.evicted_keys)

    def store_settled(self, keys) -> None:
        """One request that stores ``keys``, steps until its transfers are done, and ends."""
        req = self.request()
        self.store(keys, req)
        self.settle()
        self.finish(req)

    def step_end(self, new_req_ids=()) -> None:
        self.manager.on_schedule_end(
            ScheduleEndContext(new_req_ids=list(new_req_ids), preempted_req_ids=[])
        )

    def settle(self, timeout_s: float = 60.0) -> None:
        """Engine steps until no transfer is outstanding (a guard against hangs, not a timing)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.step_end()
            if not self.manager.has_pending_work():
                return
            assert time.monotonic() < deadline, "transfers still pending after 60 s"
            time.sleep(0.001)

    def lookup_settled(self, k: bytes, req, timeout_s: float = 60.0) -> LookupResult:
        """The manager's lookup, asked again each step while it answers RETRY (the tier's
        index still recovering), as the scheduler does."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.manager.lookup(k, req)
            if result is not LookupResult.RETRY:
                return result
            assert time.monotonic() < deadline, "lookup still RETRY after 60 s"
            self.step_end()
            time.sleep(0.001)

    def promote(self, keys, req) -> dict:
        """Looks every key up in one step, flushes the promotions vLLM started (one job per
        tier and request), waits for them, then returns each key's final lookup."""
        first = {k: self.lookup_settled(k, req) for k in keys}
        self.step_end()
        self.settle()
        return {k: (first[k], self.manager.lookup(k, req)) for k in keys}

    def load(self, keys, req) -> dict:
        """The bytes the GPU would load for keys that answer HIT: prepare_load, read, complete."""
        spec = self.manager.prepare_load(keys, req)
        rows = {k: self.read_row(int(c)) for k, c in zip(keys, spec.chunk_ids, strict=True)}
        self.manager.complete_load(keys, req)
        return rows

    def finish(self, req) -> None:
        self.manager.on_request_finished(req)

    def shutdown(self) -> None:
        self.view = None
        self.manager.shutdown()


def promote_in_another_process(extra, keys) -> dict:
    """Runs :func:`child_main` in a second Python process over the tiers of ``extra`` and
    returns its report (it must exit 0)."""
    import subprocess

    child = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()),
         json.dumps({"extra": extra, "keys": [k.hex() for k in keys]})],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


def start_hanging_child(extra, keys, hang: str, hold_file=None):
    """Starts :func:`child_main` in a second process that submits its jobs and then waits to
    be killed: ``hang="store"`` stores ``keys`` (its rows hold :func:`payload`), ``"promote"``
    promotes them. Returns the process once its jobs are submitted.

    With ``hold_file`` (the file the node service's test hook waits on) the child creates
    that file before the job the service is to hold in flight: a store first stores half the
    keys and waits until vLLM's manager has them reported done (``child.completed``: those
    keys), then creates the file and stores the rest; a promotion creates it first."""
    import subprocess

    child = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()),
         json.dumps({"extra": extra, "keys": [k.hex() for k in keys], "hang": hang,
                     "hold_file": None if hold_file is None else str(hold_file)})],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        line = child.stdout.readline()
        said = json.loads(line)
        assert said["submitted"] == hang, line
        child.completed = [bytes.fromhex(k) for k in said["completed"]]
    except BaseException:
        kill_hanging_child(child)
        raise
    return child


def kill_hanging_child(child) -> None:
    """SIGKILLs a process of :func:`start_hanging_child` and waits for it; then removes the
    ``/dev/shm`` region vLLM made for its engine, which a killed process cannot remove."""
    child.kill()
    child.wait()
    for path in harness.region_files(pid=child.pid):
        path.unlink(missing_ok=True)


def _hang(engine: Engine, keys, hang: str, hold_file: str | None) -> None:
    """Submits the jobs of ``hang`` through vLLM's manager, says so, and sleeps (see
    :func:`start_hanging_child` for ``hold_file``)."""
    req = engine.request()
    completed = []
    if hang == "store":
        if hold_file is not None:
            completed, keys = keys[: len(keys) // 2], keys[len(keys) // 2 :]
            engine.store(completed, req)
            engine.settle()
            Path(hold_file).touch()
        engine.store(keys, req)
    else:
        if hold_file is not None:
            Path(hold_file).touch()
        deadline = time.monotonic() + 60
        while any(engine.manager.lookup(k, req) is LookupResult.RETRY for k in keys):
            assert time.monotonic() < deadline, "lookups still RETRY after 60 s"
            engine.step_end()
            time.sleep(0.001)
    engine.step_end()  # the manager hands the jobs to the tiers at the step's end
    print(json.dumps({"submitted": hang, "completed": [k.hex() for k in completed]}), flush=True)
    time.sleep(600)


def child_main(argv) -> None:
    """The restart test's second process: open the tier, promote the keys, report (or, with
    ``hang``, submit and wait to be killed: :func:`start_hanging_child`)."""
    args = json.loads(argv[0])
    config = args.get("config", {})
    engine = Engine(args["extra"], **config)
    try:
        keys = [bytes.fromhex(k) for k in args["keys"]]
        if args.get("hang"):
            # Killed while it waits: the test that kills it removes its region.
            _hang(engine, keys, args["hang"], args.get("hold_file"))
            return
        req = engine.request()
        outcome = engine.promote(keys, req)
        hits = [k for k, (_, last) in outcome.items() if last is LookupResult.HIT]
        rows = engine.load(hits, req) if hits else {}
        report = {
            "first": {k.hex(): first.name for k, (first, _) in outcome.items()},
            "last": {k.hex(): last.name for k, (_, last) in outcome.items()},
            "equal": {k.hex(): rows[k] == payload(k) for k in hits},
            "namespace": engine.tier().namespace,
        }
        engine.finish(req)
        engine.settle()
    finally:
        # Also on failure: the shutdown removes vLLM's /dev/shm region of this process.
        engine.shutdown()
    print(json.dumps(report))


if __name__ == "__main__":
    child_main(sys.argv[1:])
