"""kvtier's G3 tier as SGLang's HiCache storage backend (SGLang 0.5.23, ``docs/sglang.md``).

Enable it with SGLang's own dynamic backend loader::

    --enable-hierarchical-cache --hicache-mem-layout page_first \\
    --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.sglang", "class_name": "KvtierStorage", "interface_v1": true,
        "paths": ["/mnt/nvme0/kvtier"], "capacity_bytes": "512GiB"}'

SGLang's ``StorageBackendFactory`` imports ``module_path``, takes ``class_name`` and builds it
as ``KvtierStorage(storage_config, {})``; the HiCache controller then hands over its host KV
pool with ``register_mem_pool_host`` and, because of ``"interface_v1": true``, moves pages
with ``batch_get_v1`` / ``batch_set_v1`` (without it, with ``batch_get`` / ``batch_set`` on
flat page copies, which kvtier bounces through free host pages: slower, same bytes). Every key besides SGLang's own is kvtier's ``nvme``
tier configuration (``docs/g3.md``), validated by kvtier with errors that name the key
(``extra_config.capacity``).

The host pool is adopted in place: its pages are moved between the pool and kvtier's G3 slots
by kvtier's I/O threads (``O_DIRECT``, CRC-checked), never copied in Python. Each rank opens
the G3 tier in a directory of its own under every path (``tp0``, ``tp1``, ...; ``mla`` for MLA
models), stamped with the namespace SGLang's ``HiCacheStorageConfig`` decides (model, TP rank
and size unless MLA, PP, attention CP) and the page's byte format; a directory written for
another one is refused with both named.

With ``"service_socket_path"`` (and ``"allocator": "shm"``) the rank is instead a client of
kvtier's node service (``kvtier serve --namespace ... --slot-bytes ...``), which owns one G3
pool for every rank connected to it: how the TP ranks of an MLA model share their pages, as
SGLang's own backends do (TP rank 0 stores, every rank loads; required for MLA at TP > 1).

Importing this module starts nothing and imports neither SGLang nor the extension module:
the class is built, from SGLang's ``HiCacheStorage``, when ``KvtierStorage`` is first looked
up (SGLang's factory does so).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading

__all__ = ["KvtierStorage"]

logger = logging.getLogger(__name__)

#: Keys of the extra config that SGLang (its factory, its controller, its host allocator)
#: reads; every other key is kvtier's ``nvme`` configuration.
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "allocator")
#: The file in each rank directory that records the namespace it was written under.
NAMESPACE_FILE = "kvtier-sglang.json"
#: Host pool layouts whose pages kvtier moves in place.
LAYOUTS = ("page_first", "page_first_direct", "layer_first")

_lock = threading.Lock()


def __getattr__(name: str):
    if name == "KvtierStorage":
        with _lock:
            cls = globals().get("_KvtierStorage")
            if cls is None:
                cls = _build_class()
                globals()["_KvtierStorage"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + ["KvtierStorage"])


def _native():
    from kvtier import _native

    return _native


def _config_error(msg: str):
    return _native().ConfigError(msg)


def namespace_fields(storage_config) -> dict:
    """What decides whether two ranks may share pages, as SGLang's ``file`` backend's key
    suffix does: the model, PP and attention CP always; TP rank and size unless the model is
    MLA (its KV is the same on every TP rank)."""
    mla = bool(storage_config.is_mla_model)
    return {
        "kind": "sglang-hicache",
        "version": 1,
        "model_name": storage_config.model_name or "",
        "is_mla_model": mla,
        "tp_rank": None if mla else int(storage_config.tp_rank),
        "tp_size": None if mla else int(storage_config.tp_size),
        "pp_rank": int(storage_config.pp_rank),
        "pp_size": int(storage_config.pp_size),
        "attn_cp_rank": int(storage_config.attn_cp_rank),
        "attn_cp_size": int(storage_config.attn_cp_size),
    }


def namespace_digest(fields: dict) -> str:
    """kvtier's namespace digest of ``fields`` (64 hex digits): sha256 of their JSON with
    sorted keys, no spaces, ASCII only, prefixed by what the digest is of."""
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(b"kvtier-sglang-namespace\0" + text.encode()).hexdigest()


def rank_directory(storage_config) -> str:
    """The directory of this rank under each configured path: ``tp<rank>`` (``mla`` for an MLA
    model), then ``-pp<rank>``, ``-cp<rank>`` and ``-dp<rank>`` where those are in use. Two
    processes never share one (each G3 tier locks its slabs)."""
    name = "mla" if storage_config.is_mla_model else f"tp{int(storage_config.tp_rank)}"
    if storage_config.pp_size > 1:
        name += f"-pp{int(storage_config.pp_rank)}"
    if storage_config.attn_cp_size > 1:
        name += f"-cp{int(storage_config.attn_cp_rank)}"
    if getattr(storage_config, "dp_rank", 0):
        name += f"-dp{int(storage_config.dp_rank)}"
    return name


class _PageStarts(list):
    """Token indices for ``get_page_buffer_meta`` (which reads ``len`` and ``tolist``)."""

    def tolist(self):
        return list(self)


def page_geometry(pool) -> dict:
    """Where a page of SGLang's host pool lies, from the pool's own ``get_page_buffer_meta``
    (the pointers SGLang's zero-copy backends use) for its first, second and last page: the
    pool's base and length, the pieces of a page (offsets in page 0, one size), and the
    distance from one page to the next. Refuses what kvtier cannot move in place."""
    layout = getattr(pool, "layout", None)
    if layout not in LAYOUTS:
        raise _config_error(
            f"SGLang host pool layout {layout!r}: kvtier moves pages of the layouts "
            f"{', '.join(LAYOUTS)} in place; use --hicache-mem-layout page_first"
        )
    if getattr(pool, "dcp_size", 1) != 1:
        raise _config_error(
            f"SGLang host pool with decode context parallelism (dcp_size {pool.dcp_size}): "
            "not supported by kvtier's backend"
        )
    buf = getattr(pool, "kv_buffer", None)
    if buf is None or not hasattr(pool, "get_page_buffer_meta"):
        raise _config_error(
            f"SGLang host pool {type(pool).__name__}: kvtier's backend moves the pages of "
            "SGLang's MHA and MLA token pools (one kv_buffer and get_page_buffer_meta)"
        )
    ps = int(pool.page_size)
    num_pages = int(pool.page_num)
    base = int(buf.data_ptr())
    length = int(buf.numel()) * int(buf.element_size())
    starts = [0, ps, (num_pages - 1) * ps] if num_pages > 1 else [0]
    ptrs, sizes = pool.get_page_buffer_meta(_PageStarts(s + k for s in starts for k in range(ps)))
    n = len(ptrs) // len(starts)
    if n == 0 or len(ptrs) != n * len(starts) or len(set(sizes)) != 1:
        raise _config_error(
            f"SGLang host pool ({type(pool).__name__}, {layout}): its pages are not pieces of "
            f"one size ({len(ptrs)} pointers, sizes {sorted(set(sizes))})"
        )
    pages = [ptrs[i * n : (i + 1) * n] for i in range(len(starts))]
    offsets = [p - base for p in pages[0]]
    stride = pages[1][0] - pages[0][0] if num_pages > 1 else 0
    for start, page in zip(starts, pages):
        expected = [base + off + (start // ps) * stride for off in offsets]
        if page != expected or min(offsets) < 0:
            raise _config_error(
                f"SGLang host pool ({type(pool).__name__}, {layout}): page {start // ps} is "
                "not at a fixed distance from page 0; kvtier cannot address it in place"
            )
    return {
        "layout": layout,
        "base": base,
        "length": length,
        "piece_bytes": int(sizes[0]),
        "piece_offsets": offsets,
        "page_stride": stride,
        "page_size": ps,
        "num_pages": num_pages,
        "dtype": str(getattr(pool, "dtype", "")),
        "anchor": buf,
    }


def _describe(fields: dict) -> str:
    return ", ".join(f"{k} {v!r}" for k, v in fields.items() if k not in ("kind", "version"))


def _build_class():
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    class KvtierStorage(HiCacheStorage):
        """kvtier's G3 tier as SGLang's HiCache storage backend (module docs)."""

        def __init__(self, storage_config, kwargs=None):
            self.storage_config = storage_config
            extra = dict(storage_config.extra_config or {})
            if not extra.get("interface_v1"):
                logger.warning(
                    "kvtier SGLang backend: without \"interface_v1\": true in "
                    "--hicache-storage-backend-extra-config SGLang moves flat page copies "
                    "through Python (get/set), which kvtier bounces through free host pages; "
                    "add \"interface_v1\": true to move pages in place"
                )
            if "type" in extra:
                raise _config_error(
                    "extra_config.type: not a key of kvtier's SGLang backend (the tier is "
                    "always kvtier's nvme tier)"
                )
            entry = {k: v for k, v in extra.items() if k not in SGLANG_KEYS}
            # SGLang's own rule (HiCacheStorageConfig.is_storage_writer): an MLA page is the
            # same on every TP rank and only rank 0 stores it; every rank loads it.
            writer = getattr(storage_config, "is_storage_writer", None)
            self._writer = (
                bool(writer)
                if writer is not None
                else not storage_config.is_mla_model or int(storage_config.tp_rank) == 0
            )
            self._skip_logged = False
            self._fields = namespace_fields(storage_config)
            self._rank_dir = rank_directory(storage_config)
            self._store = None
            self._stats_lock = threading.Lock()
            self._stats = ([], [], [], [])  # prefetch pgs, backup pgs, prefetch GB/s, backup GB/s
            self._metrics = bool(storage_config.enable_storage_metrics)
            self._bounce_warned = False
            socket = entry.pop("service_socket_path", None)
            if socket is not None:
                # Client mode: kvtier's node service owns the G3 pool, which every rank (and
                # every engine) connected to it shares (docs/node-service.md).
                if not isinstance(socket, (str, os.PathLike)) or not os.fspath(socket):
                    raise _config_error(
                        "extra_config.service_socket_path: expected the path of kvtier's node "
                        f"service socket, found {socket!r}"
                    )
                if entry:
                    raise _config_error(
                        f"extra_config.{sorted(entry)[0]}: with service_socket_path the node "
                        "service's own configuration holds the nvme keys (docs/node-service.md); "
                        "remove it here"
                    )
                self._socket = os.fspath(socket)
                self._entry = None
                return
            self._socket = None
            paths = entry.get("paths")
            if not isinstance(paths, list) or not paths:
                raise _config_error(
                    "extra_config.paths: required, a list of directories (one per NVMe device); "
                    "or extra_config.service_socket_path to use kvtier's node service"
                )
            if storage_config.is_mla_model and storage_config.tp_size > 1:
                # SGLang writes an MLA page from one rank and every TP rank reads it; an
                # in-process G3 tier belongs to one process.
                raise _config_error(
                    f"MLA model at TP {storage_config.tp_size}: SGLang stores each page once "
                    "(from TP rank 0) and every TP rank reads it, but a G3 tier opened in "
                    "process belongs to one process; set extra_config.service_socket_path "
                    "to the socket of kvtier's node service (kvtier serve, docs/sglang.md), "
                    "whose pool all TP ranks share"
                )
            entry["paths"] = [
                os.path.join(os.fspath(p), self._rank_dir) if isinstance(p, (str, os.PathLike)) else p
                for p in paths
            ]
            entry["type"] = "nvme"
            self._entry = entry

        # ---- the host pool ------------------------------------------------------------------

        def register_mem_pool_host(self, mem_pool_host):
            # A pool registered again replaces the first (its tier is closed first: the slabs
            # are locked by the tier that has them open).
            self.close()
            super().register_mem_pool_host(mem_pool_host)
            geo = page_geometry(mem_pool_host)
            self._page_size = geo["page_size"]
            fields = dict(self._fields)
            fields.update(
                layout=geo["layout"],
                page_size=geo["page_size"],
                dtype=geo["dtype"],
                piece_bytes=geo["piece_bytes"],
                pieces=len(geo["piece_offsets"]),
            )
            digest = namespace_digest(fields)
            if self._socket is not None:
                self._connect(mem_pool_host, geo, fields, digest)
                return
            for p in self._entry["paths"]:
                if isinstance(p, str):
                    os.makedirs(p, exist_ok=True)
            try:
                self._store = _native().SglangStore(
                    geo["base"],
                    geo["length"],
                    geo["piece_bytes"],
                    geo["piece_offsets"],
                    geo["page_stride"],
                    geo["page_size"],
                    geo["num_pages"],
                    geo["anchor"],
                    json.dumps(self._entry),
                    digest,
                )
            except _native().ConfigError as e:
                raise self._explain(e, fields) from None
            record = {"fields": fields, "namespace": self._store.namespace}
            for p in self._entry["paths"]:
                path = os.path.join(p, NAMESPACE_FILE)
                if not os.path.exists(path):
                    with open(path + ".tmp", "w") as f:
                        json.dump(record, f, indent=1, sort_keys=True)
                    os.replace(path + ".tmp", path)
            logger.info(
                "kvtier SGLang backend: %s, namespace %s, %d piece(s) of %d bytes per page, "
                "in %s",
                geo["layout"],
                self._store.namespace[:16],
                self._store.pieces,
                self._store.piece_bytes,
                ", ".join(self._entry["paths"]),
            )

        def _connect(self, pool, geo, fields, digest):
            """Client mode: registers the host pool with kvtier's node service by its file
            descriptor (SGLang's ``"allocator": "shm"``)."""
            allocator = getattr(pool, "allocator", None)
            fd = getattr(pool, "fd", None)
            if fd is None:
                fd = getattr(allocator, "fd", None)
            mm = getattr(allocator, "mm", None)
            if fd is None or mm is None:
                raise _config_error(
                    "extra_config.service_socket_path: kvtier's node service maps SGLang's host "
                    "pool through its file descriptor; add \"allocator\": \"shm\" to "
                    "--hicache-storage-backend-extra-config (this pool's allocator, "
                    f"{type(allocator).__name__}, has none)"
                )
            import ctypes

            view = ctypes.c_char.from_buffer(mm)
            start = ctypes.addressof(view)
            del view
            if start != geo["base"] or len(mm) < geo["length"]:
                raise _config_error(
                    "extra_config.service_socket_path: SGLang's host pool does not start at "
                    "offset 0 of its shared memory file; kvtier's node service cannot map it"
                )
            engine = f"sglang-{self._rank_dir}-pid{os.getpid()}"
            try:
                self._store = _native().SglangStore.connect(
                    self._socket,
                    int(fd),
                    geo["length"],
                    geo["piece_bytes"],
                    geo["piece_offsets"],
                    geo["page_stride"],
                    geo["page_size"],
                    geo["num_pages"],
                    geo["anchor"],
                    digest,
                    engine,
                )
            except (_native().ConfigError, _native().KvtierError) as e:
                raise type(e)(
                    f"extra_config.service_socket_path {self._socket}: {e}. This SGLang rank "
                    f"presents namespace {digest} with slots of {geo['piece_bytes']} bytes "
                    f"({_describe(fields)}); a node service for it runs as `kvtier serve "
                    f"--config <service config> --namespace {digest} --slot-bytes "
                    f"{geo['piece_bytes']}`"
                ) from None
            logger.info(
                "kvtier SGLang backend: client of the node service at %s (%s, %s, namespace "
                "%s, %d piece(s) of %d bytes per page; %s)",
                self._socket,
                engine,
                geo["layout"],
                digest,
                self._store.pieces,
                self._store.piece_bytes,
                "stores and loads" if self._writer else "loads (TP rank 0 stores)",
            )

        def _explain(self, error, fields):
            """A namespace refusal, with what the directory holds and what this rank is."""
            # The slabs' slot size is checked first (another piece size: another page format),
            # then their namespace digest.
            if not any(m in str(error) for m in ("namespace digest differs", "row_stride differs")):
                return error
            for p in self._entry["paths"]:
                try:
                    with open(os.path.join(p, NAMESPACE_FILE)) as f:
                        stored = json.load(f)["fields"]
                except (OSError, ValueError, KeyError, TypeError):
                    continue
                differ = {k for k in set(stored) | set(fields) if stored.get(k) != fields.get(k)}
                return _config_error(
                    f"{p}: this tier directory holds pages of another model or rank layout "
                    f"({_describe({k: stored.get(k) for k in sorted(differ)})}); this SGLang "
                    f"rank writes {_describe({k: fields.get(k) for k in sorted(differ)})}. Use "
                    "another directory, or empty it on purpose with `kvtier tier clear`. "
                    f"({error})"
                )
            return error

        def _require(self):
            if self._store is None:
                raise _native().KvtierError(
                    "kvtier's SGLang backend has no host pool yet (register_mem_pool_host)"
                )
            return self._store

        def _starts(self, keys, host_indices):
            ps = self._page_size
            if len(host_indices) != len(keys) * ps:
                raise ValueError(
                    f"{len(keys)} pages of {ps} tokens need {len(keys) * ps} host indices, "
                    f"got {len(host_indices)}"
                )
            return host_indices[::ps].tolist()

        def _record(self, pages, bandwidth, ok, nbytes, seconds):
            if not self._metrics:
                return
            with self._stats_lock:
                pages.append(sum(ok))
                bandwidth.append(nbytes / seconds / 1e9 if seconds > 0 else 0.0)

        # ---- the v1 (zero-copy) interface ---------------------------------------------------

        def batch_exists(self, keys, extra_info=None) -> int:
            return self._require().exists_prefix([str(k) for k in keys])

        def batch_get_v1(self, keys, host_indices, extra_info=None):
            store = self._require()
            ok, nbytes, seconds = store.load([str(k) for k in keys], self._starts(keys, host_indices))
            self._record(self._stats[0], self._stats[2], ok, nbytes, seconds)
            return ok

        def _skip_store(self, n):
            """A rank SGLang does not let store (MLA, TP rank > 0): as SGLang's hf3fs backend
            does, report the pages stored without writing them; TP rank 0 stores them."""
            if self._writer:
                return False
            if not self._skip_logged:
                self._skip_logged = True
                logger.info(
                    "kvtier SGLang backend: MLA TP rank %d stores nothing (TP rank 0 stores "
                    "every page; %d page(s) in this first batch)",
                    int(self.storage_config.tp_rank),
                    n,
                )
            return True

        def batch_set_v1(self, keys, host_indices, extra_info=None):
            store = self._require()
            if self._skip_store(len(keys)):
                return [True] * len(keys)
            ok, nbytes, seconds = store.store(
                [str(k) for k in keys], self._starts(keys, host_indices)
            )
            self._record(self._stats[1], self._stats[3], ok, nbytes, seconds)
            return ok

        # ---- the older interface ------------------------------------------------------------
        # Flat page copies (SGLang's controller uses them without "interface_v1"): each batch
        # borrows free pages of the host pool as a bounce, through the pool's own allocator,
        # copies with its own set_from_flat_data_page / get_data_page, and moves the bounce
        # pages like batch_set_v1 / batch_get_v1. Slower than the v1 interface (a copy each
        # way, in Python), same keys and bytes.

        def exists(self, key) -> bool:
            return self.batch_exists([key]) == 1

        def _borrow(self, n):
            """Host indices of ``n`` free pages of the pool, or None (logged once)."""
            idx = self.mem_pool_host.alloc(n * self._page_size)
            if idx is None and not self._bounce_warned:
                self._bounce_warned = True
                logger.warning(
                    "kvtier SGLang backend: no free host pages to bounce %d flat page(s) "
                    "through; those pages miss (set \"interface_v1\": true to move pages in "
                    "place)",
                    n,
                )
            return idx

        def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
            store, pool, ps = self._require(), self.mem_pool_host, self._page_size
            if self._skip_store(len(keys)):
                return True
            idx = self._borrow(len(keys))
            if idx is None:
                return False
            try:
                starts = idx[::ps].tolist()
                for start, value in zip(starts, values):
                    pool.set_from_flat_data_page(start, value)
                ok, nbytes, seconds = store.store([str(k) for k in keys], starts)
            finally:
                pool.free(idx)
            self._record(self._stats[1], self._stats[3], ok, nbytes, seconds)
            return all(ok)

        def batch_get(self, keys, target_locations=None, target_sizes=None):
            store, pool, ps = self._require(), self.mem_pool_host, self._page_size
            idx = self._borrow(len(keys))
            if idx is None:
                return [None] * len(keys)
            out = []
            try:
                starts = idx[::ps].tolist()
                ok, nbytes, seconds = store.load([str(k) for k in keys], starts)
                targets = target_locations or [None] * len(keys)
                for good, start, target in zip(ok, starts, targets):
                    if not good:
                        out.append(None)
                        continue
                    page = pool.get_data_page(start, flat=True)
                    if target is None:
                        out.append(page.clone() if hasattr(page, "clone") else page.copy())
                    else:
                        target[:] = page
                        out.append(target)
            finally:
                pool.free(idx)
            self._record(self._stats[0], self._stats[2], ok, nbytes, seconds)
            return out

        def get(self, key, target_location=None, target_sizes=None):
            return self.batch_get([key], [target_location])[0]

        def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
            return self.batch_set([key], [value])

        # ---- administration -----------------------------------------------------------------

        def clear(self) -> bool:
            store = self._require()
            if store.client:
                # The service's pool is every connected engine's: one rank does not empty it.
                logger.warning(
                    "kvtier SGLang backend: clear ignored: this rank is a client of the node "
                    "service at %s, whose pool every engine shares (stop the service and run "
                    "`kvtier tier clear` on its paths to empty it)",
                    self._socket,
                )
                return False
            store.clear()
            logger.info("kvtier SGLang backend: cleared %s", ", ".join(self._entry["paths"]))
            return True

        def get_stats(self):
            from sglang.srt.observability.metrics_collector import StorageMetrics

            metrics = StorageMetrics()
            with self._stats_lock:
                for src, dst in zip(
                    self._stats,
                    (
                        metrics.prefetch_pgs,
                        metrics.backup_pgs,
                        metrics.prefetch_bandwidth,
                        metrics.backup_bandwidth,
                    ),
                ):
                    dst.extend(src)
                    src.clear()
            return metrics

        def kvtier_metrics(self):
            """kvtier's own counters and gauges: ``(name, kind, labels, value)``."""
            return self._require().metrics()

        @property
        def namespace(self) -> str:
            """kvtier's namespace digest (64 hex digits) that the slabs carry."""
            return self._require().namespace

        def close(self):
            store, self._store = self._store, None
            if store is not None:
                store.shutdown()

    KvtierStorage.__module__ = __name__
    KvtierStorage.__qualname__ = "KvtierStorage"
    return KvtierStorage
