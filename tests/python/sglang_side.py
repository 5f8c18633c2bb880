"""SGLang 0.5.23's own code around kvtier's HiCache backend, run in a process of its own.

SGLang's scheduler-side modules are imported from the release wheel's sources
(``fetch_sglang.py``) with the metadata-only torch of ``stubs/`` and placeholders for what
they import but never use here (``SGLANG_STAND_INS``), under SGLang's own CPU platform
(``SGLANG_USE_CPU_ENGINE=1``). vLLM's stand-ins (the pytest process's) are not installed here:
SGLang probes ``transformers`` at import and must find it absent.

What needs torch's data or a GPU is taken from SGLang's sources function by function
(:func:`sglang_functions`, compiled from the wheel's text, never copied): the host pools'
``init_kv_buffer``, ``get_page_buffer_meta``, ``get_data_page`` and
``set_from_flat_data_page``, the HiCache controller's page functions (``_page_set_zero_copy``,
``_page_get_zero_copy`` for a v1 backend, ``_generic_page_set``, ``_generic_page_get`` for the
``file`` backend) and ``StorageMetrics``. The host pool itself is a stand-in
(:class:`HostPool`) over real shared memory (an anonymous ``MAP_SHARED`` mapping, as SGLang's
``alloc_mmap`` makes it) whose tensors are numpy arrays with the few torch methods SGLang's
code calls (:class:`TArray`).

Run as ``python sglang_side.py SCENARIO`` with a JSON document on stdin; prints one JSON line.
"""

from __future__ import annotations

import ast
import json
import mmap
import os
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: What SGLang's storage modules import but never use on these paths.
SGLANG_STAND_INS = (
    "orjson", "triton", "starlette", "pybase64", "requests", "PIL", "tqdm", "IPython", "aiohttp",
)


def setup(src: str) -> None:
    """sys.path, stand-ins and SGLang's CPU platform, before SGLang is imported."""
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE / "stubs"))
    import kvtier_placeholders

    kvtier_placeholders.install(SGLANG_STAND_INS)
    import torch.cuda  # noqa: F401  (SGLang probes torch.cuda.is_available())

    sys.path.insert(0, src)


def sglang_functions(src: str, relpath: str, owner: str | None, names, namespace: dict) -> dict:
    """SGLang's own definitions ``names`` (of class ``owner``, or of the module), compiled from
    the wheel's source file with ``namespace`` as their globals."""
    tree = ast.parse(Path(src, relpath).read_text())
    body = tree.body
    if owner is not None:
        (cls,) = [n for n in body if isinstance(n, ast.ClassDef) and n.name == owner]
        body = cls.body
    found = [n for n in body if getattr(n, "name", None) in names]
    missing = set(names) - {n.name for n in found}
    if missing:
        raise LookupError(f"{relpath}: {owner}: no {sorted(missing)}")
    for n in found:
        if isinstance(n, ast.FunctionDef):
            # Property/synchronized decorators are the class's business, not ours.
            n.decorator_list = [d for d in n.decorator_list if getattr(d, "id", "") == "dataclass"]
    module = ast.Module(
        body=[ast.ImportFrom(module="__future__", names=[ast.alias("annotations")], level=0), *found],
        type_ignores=[],
    )
    ast.fix_missing_locations(module)
    exec(compile(module, f"{src}/{relpath}", "exec"), namespace)
    return {name: namespace[name] for name in names}


# ---- tensors over real memory ---------------------------------------------------------------

import numpy as np  # noqa: E402

_NP = {"float16": np.float16, "uint8": np.uint8, "int64": np.int64, "int8": np.int8}


class TArray(np.ndarray):
    """A numpy array with the torch methods SGLang's host-pool and file-backend code call."""

    def numel(self):
        return self.size

    def element_size(self):
        return self.itemsize

    def data_ptr(self):
        return self.__array_interface__["data"][0]

    def view(self, *args, **kwargs):
        dtype = kwargs.pop("dtype", args[0] if args else None)
        name = getattr(dtype, "_name", None)
        if isinstance(name, str) and name in _NP and not isinstance(dtype, (type, np.dtype)):
            return np.ndarray.view(self, _NP[name]).view(TArray)
        return np.ndarray.view(self, *args, **kwargs)

    def contiguous(self):
        return np.ascontiguousarray(self).view(TArray)

    def numpy(self):
        return np.asarray(self)


def shared_tensor(dims, dtype):
    """``dims`` of ``dtype`` in an anonymous shared mapping (SGLang's ``alloc_mmap`` shape)."""
    n = int(np.prod(dims)) * dtype.itemsize
    mm = mmap.mmap(-1, n, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    arr = np.frombuffer(mm, dtype=_NP[dtype._name]).reshape(dims).view(TArray)
    return arr


class ShmAllocator:
    """SGLang's ``ShmHostTensorAllocator`` (``"allocator": "shm"``) over numpy: each buffer in
    a memfd of its own, mapped shared from offset 0; ``fd`` and ``mm`` are the first's."""

    def __init__(self):
        self.fds, self.mms = [], []

    @property
    def fd(self):
        return self.fds[0] if self.fds else None

    @property
    def mm(self):
        return self.mms[0] if self.mms else None

    def allocate(self, dims, dtype, device):
        n = int(np.prod(dims)) * dtype.itemsize
        fd = os.memfd_create("sglang_host_pool_standin", os.MFD_CLOEXEC)
        os.ftruncate(fd, n)
        mm = mmap.mmap(fd, n, flags=mmap.MAP_SHARED)
        self.fds.append(fd)
        self.mms.append(mm)
        return np.frombuffer(mm, dtype=_NP[dtype._name]).reshape(dims).view(TArray)


class HostPool:
    """A stand-in for SGLang's MHA or MLA host pool: SGLang's own methods over real memory."""

    def __init__(self, src, kind, layout, page_size, page_num, layer_num, head_num=2, head_dim=256,
                 reserved=None, shm=False):
        import logging

        import torch

        self.layout, self.page_size, self.page_num = layout, page_size, page_num
        self.size = page_num * page_size
        self.layer_num, self.dtype = layer_num, torch.float16
        self.device, self.pin_memory = "cpu", False
        self.allocator = ShmAllocator() if shm else None
        self.dcp_size, self.logical_page_size = 1, page_size
        self._transfer_device = types.SimpleNamespace(type="cpu")
        ns = {
            "torch": torch,
            "logger": logging.getLogger("sglang_side"),
            "ALLOC_MEMORY_FUNCS": {
                "cpu": lambda dims, dtype, allocator=None, **_: (
                    allocator.allocate(dims, dtype, "cpu") if allocator else shared_tensor(dims, dtype)
                )
            },
        }
        names = ["init_kv_buffer", "get_page_buffer_meta", "get_data_page", "set_from_flat_data_page"]
        if kind == "mha":
            self.head_num, self.head_dim, self.v_head_dim = head_num, head_dim, head_dim
            fns = sglang_functions(src, "sglang/srt/mem_cache/pool_host/mha.py", "MHATokenToKVPoolHost", names, ns)
        else:
            self.kv_cache_dim = head_dim
            names.append("_storage_page_index")
            fns = sglang_functions(src, "sglang/srt/mem_cache/pool_host/mla.py", "MLATokenToKVPoolHost", names, ns)
        for name, fn in fns.items():
            setattr(self, name, types.MethodType(fn, self))
        self.kv_buffer = self.init_kv_buffer()
        self.fd = getattr(self.allocator, "fd", None)  # as SGLang's HostKVCache sets it
        # The pool's allocator (SGLang's works on torch tensors): pages from ``reserved`` on
        # are free; the scenarios use the pages below it directly.
        self._free = list(range(page_num if reserved is None else reserved, page_num))

    def alloc(self, need_size):
        n = need_size // self.page_size
        if n > len(self._free):
            return None
        pages, self._free = self._free[:n], self._free[n:]
        return self.indices(pages)

    def free(self, indices):
        self._free.extend(sorted({int(i) // self.page_size for i in indices}))

    def fill(self, page: int, seed: int) -> None:
        """Distinct bytes into every byte of one page (through SGLang's flat page order)."""
        rng = np.random.default_rng(seed)
        n = self.get_data_page(page * self.page_size).size * 2
        self.set_from_flat_data_page(page * self.page_size, rng.integers(0, 256, n, dtype=np.uint8).view(np.float16).view(TArray))

    def get_dummy_flat_data_page(self):
        # SGLang's builds torch.zeros of one flat page; the same, in numpy.
        return np.zeros(self.get_data_page(0).size, np.float16).view(TArray)

    def page_bytes(self, page: int) -> bytes:
        return self.get_data_page(page * self.page_size).view(np.uint8).tobytes()

    def zero(self) -> None:
        np.ndarray.view(self.kv_buffer, np.uint8)[...] = 0

    def indices(self, pages):
        return np.array([p * self.page_size + k for p in pages for k in range(self.page_size)], dtype=np.int64).view(TArray)


# ---- SGLang's controller and config ---------------------------------------------------------


class Controller:
    """The HiCache controller's storage page functions (SGLang's own) around one backend."""

    def __init__(self, src, backend, pool, zero_copy):
        import logging

        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

        self.storage_backend, self.storage_host_pool, self.page_size = backend, pool, pool.page_size
        ns = {"logger": logging.getLogger("sglang_side"), "HiCacheStorageExtraInfo": HiCacheStorageExtraInfo}
        fns = sglang_functions(
            src, "sglang/srt/managers/cache_controller.py", "HiCacheController",
            ["_page_set_zero_copy", "_page_get_zero_copy", "_generic_page_set", "_generic_page_get"], ns,
        )
        for name, fn in fns.items():
            setattr(self, name, types.MethodType(fn, self))
        # The controller's choice: a dynamic backend with "interface_v1" gets the zero-copy
        # functions, the file backend the generic (flat page) ones.
        self.zero_copy = zero_copy

    def set(self, keys, pages):
        idx = self.storage_host_pool.indices(pages)
        fn = self._page_set_zero_copy if self.zero_copy else self._generic_page_set
        return bool(fn(keys, idx))

    def get(self, keys, pages) -> int:
        """Pages loaded, from the first (the controller's count)."""
        idx = self.storage_host_pool.indices(pages)
        op = types.SimpleNamespace(request_id="r", is_terminated=lambda: False)
        fn = self._page_get_zero_copy if self.zero_copy else self._generic_page_get
        return fn(op, keys, idx)


def storage_config(extra, model="org/model-a", tp_rank=0, tp_size=1, mla=False):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=True, is_page_first_layout=False,
        model_name=model, extra_config=dict(extra),
    )


def backend(src, kind, extra, pool, **cfg):
    """SGLang's factory builds the backend as the controller does, then registers the pool."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    b = StorageBackendFactory.create_backend(kind, storage_config(extra, **cfg), pool)
    b.register_mem_pool_host(pool)
    return b


def install_storage_metrics(src):
    """``sglang.srt.observability.metrics_collector.StorageMetrics`` (SGLang's own dataclass;
    the module itself imports model configuration code)."""
    from dataclasses import dataclass, field
    from typing import List

    name = "sglang.srt.observability.metrics_collector"
    mod = types.ModuleType(name)
    ns = {"dataclass": dataclass, "field": field, "List": List}
    mod.StorageMetrics = sglang_functions(
        src, "sglang/srt/observability/metrics_collector.py", None, ["StorageMetrics"], ns
    )["StorageMetrics"]
    sys.modules[name] = mod


def main() -> None:
    scenario = sys.argv[1]
    doc = json.loads(sys.stdin.read())
    src = doc["src"]
    setup(src)
    install_storage_metrics(src)
    out = SCENARIOS[scenario](src, doc)
    print(json.dumps(out))


# ---- scenarios (each returns observations; test_kvtier_sglang.py judges them) -------------------

import hashlib  # noqa: E402


def page_key(i: int, salt: str = "") -> str:
    return hashlib.sha256(f"page-{salt}{i}".encode()).hexdigest()


def kvtier_extra(paths, **more):
    return {"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierStorage",
            "interface_v1": True, "paths": paths, "capacity_bytes": "8MiB", "direct_io": "auto",
            "fsync": "never", "region_huge_pages": "never", **more}


def client_extra(socket, **more):
    """kvtier's backend as a client of the node service at ``socket`` (SGLang's shm host
    allocator, so the pool has a file descriptor)."""
    return {"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierStorage",
            "interface_v1": True, "allocator": "shm", "service_socket_path": socket, **more}


def open_pair(src, which, kind, layout, page_size, directory, **cfg):
    """A fresh host pool (pages 0-7 for the scenario, 8-11 free), and SGLang's factory's
    backend over it: kvtier (``kvtier-flat``: without ``interface_v1``) or file."""
    pool = HostPool(src, kind, layout, page_size, page_num=12, layer_num=4, head_dim=256, reserved=8)
    if which in ("kvtier", "kvtier-flat"):
        v1 = which == "kvtier"
        extra = kvtier_extra([directory], interface_v1=v1)
        b = backend(src, "dynamic", extra, pool, mla=kind == "mla", **cfg)
        return pool, b, Controller(src, b, pool, zero_copy=v1)
    extra = {"file_storage_path": directory}
    b = backend(src, "file", extra, pool, mla=kind == "mla", **cfg)
    return pool, b, Controller(src, b, pool, zero_copy=False)


def roundtrip(src, doc):
    """Per case and backend: store pages 0-3 (keys 0-3) and page 5 (key 5), wipe the pool,
    ask which prefix exists, load keys 0-3 into pages 4-7; byte digests of what came back."""
    out = []
    for case in doc["cases"]:
        kind, layout, ps = case["kind"], case["layout"], case["page_size"]
        row = {"case": case}
        for which in ("kvtier", "kvtier-flat", "file"):
            d = os.path.join(doc["dir"], f"{kind}-{layout}-{which}")
            pool, b, ctl = open_pair(src, which, kind, layout, ps, d)
            keys = [page_key(i, d) for i in range(6)]
            for p in range(8):
                pool.fill(p, seed=p + 1)
            orig = [hashlib.sha256(pool.page_bytes(p)).hexdigest() for p in range(8)]
            stored = ctl.set(keys[:4], [0, 1, 2, 3]) and ctl.set(keys[5:], [5])
            pool.zero()
            prefix = b.batch_exists(keys)
            prefix_hole = b.batch_exists(keys[3:])  # key 4 was never stored
            loaded = ctl.get(keys[:4], [4, 5, 6, 7])
            got = [hashlib.sha256(pool.page_bytes(p)).hexdigest() for p in range(8)]
            r = {"stored": stored, "prefix": prefix, "prefix_from_3": prefix_hole, "loaded": loaded,
                 "orig": orig, "got": got}
            if which.startswith("kvtier"):
                r["free_pages_after"] = len(pool._free)
                store = b._store
                r.update(pieces=store.pieces, piece_bytes=store.piece_bytes)
                stats = b.get_stats()
                r["stats"] = {k: getattr(stats, k) for k in ("prefetch_pgs", "backup_pgs")}
                r["stats_type"] = type(stats).__name__
                r["cleared"] = b.clear()
                r["prefix_after_clear"] = b.batch_exists(keys)
                b.close()
            row[which] = r
        out.append(row)
    return out


def store_pages(src, doc):
    """Process 1: store pages 0-2 (MHA page_first), close; the bytes of page 1's first piece."""
    which = doc["which"]
    pool, b, ctl = open_pair(src, which, "mha", "page_first", 4, doc["dir"])
    keys = [page_key(i) for i in range(3)]
    for p in range(3):
        pool.fill(p, seed=100 + p)
    ok = ctl.set(keys, [0, 1, 2])
    snippet = pool.page_bytes(1)[4096:4096 + 64].hex()  # inside page 1's K piece
    orig = [hashlib.sha256(pool.page_bytes(p)).hexdigest() for p in range(3)]
    if which == "kvtier":
        b.close()
    return {"stored": ok, "snippet": snippet, "orig": orig, "pid": os.getpid()}


def load_pages(src, doc):
    """Process 2 (a restart): which pages exist, load them into pages 3-5, digests; then ask
    again (a page that failed its CRC must be a miss now)."""
    which = doc["which"]
    pool, b, ctl = open_pair(src, which, "mha", "page_first", 4, doc["dir"])
    keys = [page_key(i) for i in range(3)]
    prefix = b.batch_exists(keys)
    per_page = b.batch_get_v1(keys, pool.indices([3, 4, 5])) if which == "kvtier" else [
        b.get(k, pool.get_dummy_flat_data_page()) is not None for k in keys]
    if which == "file":
        ctl.get(keys, [3, 4, 5])
    got = [hashlib.sha256(pool.page_bytes(p)).hexdigest() for p in (3, 4, 5)]
    r = {"prefix": prefix, "per_page": [bool(x) for x in per_page], "got": got, "pid": os.getpid(),
         "prefix_after": b.batch_exists(keys)}
    if which == "kvtier":
        r["checksum_failures"] = sum(v for n, _, _, v in b.kvtier_metrics() if n == "g3_checksum_failures")
        b.close()
    return r


def refusals(src, doc):
    """Messages of what kvtier's backend refuses, built through SGLang's factory."""
    d = doc["dir"]
    out = {}

    def attempt(name, fn):
        try:
            b = fn()
        except Exception as e:  # noqa: BLE001 (the message is the observation)
            out[name] = f"{type(e).__name__}: {e}"
        else:
            out[name] = None
            b.close()

    def kv(extra, layout="page_first", ps=4, kind="mha", **cfg):
        pool = HostPool(src, kind, layout, ps, page_num=8, layer_num=4, head_dim=256)
        return backend(src, "dynamic", extra, pool, mla=kind == "mla", **cfg)

    base = os.path.join(d, "ns")
    attempt("model_a", lambda: kv(kvtier_extra([base])))
    attempt("model_b", lambda: kv(kvtier_extra([base]), model="org/model-b"))
    attempt("tp_size_2", lambda: kv(kvtier_extra([base]), tp_size=2))
    attempt("layout_first", lambda: kv(kvtier_extra([base]), layout="layer_first"))
    attempt("misspelt_key", lambda: kv({**kvtier_extra([os.path.join(d, "x")]), "capacity": "1GiB"}))
    attempt("bad_capacity", lambda: kv({**kvtier_extra([os.path.join(d, "y")]), "capacity_bytes": "lots"}))
    attempt("small_pieces", lambda: kv(kvtier_extra([os.path.join(d, "z")]), layout="layer_first", ps=1))
    attempt("mla_tp2", lambda: kv(kvtier_extra([os.path.join(d, "m")]), kind="mla", tp_size=2))
    attempt("tp1_rank1_dir", lambda: kv(kvtier_extra([base]), tp_rank=1, tp_size=2))
    client = client_extra(os.path.join(d, "no-service.sock"))
    attempt("client_nvme_key", lambda: kv({**client, "capacity_bytes": "1GiB"}, kind="mla", tp_size=2))
    # The stand-in pool without "allocator": "shm" has no file descriptor to hand over.
    attempt("client_no_shm", lambda: kv(client, kind="mla", tp_size=2))
    out["dirs"] = sorted(os.listdir(base))
    return out


def gil(src, doc):
    """Another Python thread runs while batch_set_v1 and batch_exists wait in kvtier."""
    import threading
    import time

    pool = HostPool(src, "mha", "page_first", 16, page_num=64, layer_num=8, head_dim=256)
    b = backend(src, "dynamic", {**kvtier_extra([doc["dir"]]), "capacity_bytes": "64MiB", "fsync": "always"}, pool)
    keys = [page_key(i, "gil") for i in range(64)]
    ticks = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1

    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.01)
    t0 = time.process_time()
    before = ticks[0]
    ok = b.batch_set_v1(keys, pool.indices(range(64)))
    during = ticks[0] - before
    stop.set()
    t.join()
    b.close()
    return {"stored": sum(ok), "ticks_during": during, "cpu": time.process_time() - t0}


def two_threads(src, doc):
    """SGLang's prefetch and backup threads at once: one thread stores pages 32-63 while
    another loads pages 0-31 (stored before) into pages 64-95, each through its own calls;
    every page must come back whole."""
    import threading

    pool = HostPool(src, "mha", "page_first", 4, page_num=96, layer_num=4, head_dim=256)
    b = backend(src, "dynamic", {**kvtier_extra([doc["dir"]]), "capacity_bytes": "16MiB"}, pool)
    keys = [page_key(i, "threads") for i in range(64)]
    for p in range(64):
        pool.fill(p, seed=1000 + p)
    orig = [hashlib.sha256(pool.page_bytes(p)).hexdigest() for p in range(64)]
    first = b.batch_set_v1(keys[:32], pool.indices(range(32)))
    results = {}

    def store():
        results["store"] = [b.batch_set_v1(keys[32 + i : 36 + i], pool.indices(range(32 + i, 36 + i)))
                            for i in range(0, 32, 4)]

    def load():
        results["load"] = [b.batch_get_v1(keys[i : i + 4], pool.indices(range(64 + i, 68 + i)))
                           for i in range(0, 32, 4)]

    threads = [threading.Thread(target=store), threading.Thread(target=load)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = [hashlib.sha256(pool.page_bytes(p)).hexdigest() for p in range(64, 96)]
    prefix = b.batch_exists(keys)
    b.close()
    return {"first": first, "store": results["store"], "load": results["load"],
            "loaded_equal": got == orig[:32], "prefix": prefix}


def tp_rank(src, doc):
    """One TP rank of an MLA or MHA model at TP ``tp_size`` (its own process): a host pool
    (``"allocator": "shm"``), SGLang's factory's backend (kvtier: ``extra`` as given;
    ``file``: SGLang's file backend on ``dir``). Fills pages 0-3 with the rank's own bytes
    (seeds from ``seed``) and stores them under keys 0-3 through the controller, unless
    SGLang's controller skips the backup on this rank (its ``backup_skip``:
    ``not storage_config.is_storage_writer``), in which case it calls the backend's
    ``batch_set_v1`` directly (what a rank that stored anyway would write). Then: the
    existing prefix of keys 0-3, those pages loaded into pages 4-7, and digests."""
    import logging

    kind, which = doc["kind"], doc["which"]
    pool = HostPool(src, kind, "page_first", 4 if kind == "mha" else 8, page_num=12, layer_num=4,
                    head_dim=256, reserved=8, shm=True)
    cfg = dict(tp_rank=doc["tp_rank"], tp_size=doc["tp_size"], mla=kind == "mla")
    sc = storage_config({}, **cfg)
    # SGLang's own HiCacheController.backup_skip, on a controller holding this config.
    skip_fn = sglang_functions(src, "sglang/srt/managers/cache_controller.py", "HiCacheController",
                               ["backup_skip"], {})["backup_skip"]
    backup_skip = skip_fn(types.SimpleNamespace(storage_config=sc))
    out = {"backup_skip": backup_skip, "pid": os.getpid()}
    try:
        if which == "kvtier":
            b = backend(src, "dynamic", doc["extra"], pool, **cfg)
        else:
            b = backend(src, "file", {"file_storage_path": doc["dir"]}, pool, **cfg)
    except Exception as e:  # noqa: BLE001 (the message is the observation)
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    ctl = Controller(src, b, pool, zero_copy=which == "kvtier")
    keys = [page_key(i, doc.get("salt", "")) for i in range(4)]
    for p in range(4):
        pool.fill(p, seed=doc["seed"] + p)
    out["orig"] = [hashlib.sha256(pool.page_bytes(p)).hexdigest() for p in range(4)]
    if doc.get("store", True):
        if not backup_skip:
            out["stored"] = ctl.set(keys, [0, 1, 2, 3])
        elif which == "kvtier":
            # Keys of its own, so that what a write would leave is seen apart from rank 0's.
            own = [page_key(i, "skipped") for i in range(4)]
            out["stored_anyway"] = [bool(x) for x in b.batch_set_v1(own, pool.indices([0, 1, 2, 3]))]
            out["prefix_stored_anyway"] = b.batch_exists(own)
    out["prefix"] = b.batch_exists(keys)
    out["loaded"] = ctl.get(keys, [4, 5, 6, 7])
    out["got"] = [hashlib.sha256(pool.page_bytes(p)).hexdigest() for p in range(4, 8)]
    if which == "kvtier":
        out["client"] = b._store.client
        out["namespace"] = b.namespace
        out["cleared"] = b.clear()
        b.close()
    logging.shutdown()
    return out


SCENARIOS = {"tp_rank": tp_rank, "two_threads": two_threads, "roundtrip": roundtrip, "store_pages": store_pages, "load_pages": load_pages,
             "refusals": refusals, "gil": gil}


if __name__ == "__main__":
    main()
