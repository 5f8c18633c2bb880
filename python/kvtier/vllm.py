"""kvtier as vLLM 0.33's out-of-tree secondary tier.

Enable it with one ``secondary_tiers`` entry (the full command line is in ``docs/vllm.md``)::

    {"type": "KvtierTier", "module_path": "kvtier.vllm", "locality": "LOCAL",
     "paths": ["/mnt/nvme0/kvtier"], "capacity_bytes": "1TiB"}

vLLM's ``SecondaryTierFactory`` imports ``module_path`` and takes the attribute named by
``type``. Every other key is kvtier's ``nvme`` tier configuration (``docs/g3.md``), validated by
kvtier with errors that name the key (``secondary_tiers[0].capacity_bytes``).

``KvtierTier`` adopts vLLM's primary region in place (the base address and length of a flat
byte view of the memoryview vLLM passes, the row stride from ``strides[0]``) and moves whole
rows between it and kvtier's G3 slots on kvtier's own I/O threads: no byte of KV passes through
Python. Every call returns in microseconds with the GIL released while it is in kvtier; only
``drain_jobs`` and ``shutdown`` wait.

Importing this module is cheap and starts nothing: vLLM's base classes are imported, and the
class built, when ``KvtierTier`` is first looked up (vLLM has loaded them by then); the
extension module is loaded when a metric definition or a tier is first needed.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

__all__ = ["KvtierTier"]

logger = logging.getLogger(__name__)

#: The ``type`` of the ``secondary_tiers`` entry (vLLM takes it as the class name).
TIER_CLASS = "KvtierTier"
#: Prefix of kvtier's own metrics in vLLM's Prometheus output.
METRIC_PREFIX = "vllm:kvtier_"
#: Keys vLLM's factory consumes before calling the constructor.
_FACTORY_KEYS = ("type", "module_path", "backpressure")

_lock = threading.Lock()


def __getattr__(name: str):
    if name == "KvtierTier":
        with _lock:
            cls = globals().get("_KvtierTier")
            if cls is None:
                cls = _build_class()
                globals()["_KvtierTier"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + ["KvtierTier"])


def _native():
    from kvtier import _native

    return _native


def spec_fields(offloading_spec, row_stride: int) -> dict:
    """What vLLM's scheduler knows about the bytes it offloads, as kvtier's namespace reads
    it (``kvtier::canonical::VllmSpecFields``): from the normalised ``OffloadingConfig``."""
    cfg = offloading_spec.config
    parallel = cfg.parallel
    return {
        "model_name": cfg.model.name,
        "dtype": str(cfg.model.dtype),
        "tokens_per_hash": int(cfg.cache.tokens_per_hash),
        "blocks_per_chunk": int(offloading_spec.blocks_per_chunk),
        "tp_size": int(parallel.tp_size),
        "pp_size": int(parallel.pp_size),
        "pcp_size": int(parallel.pcp_size),
        "dcp_size": int(parallel.dcp_size),
        "world_size": int(parallel.world_size),
        "is_parallelism_agnostic": bool(parallel.is_parallelism_agnostic),
        "kv_cache_groups": [
            {"tokens_per_block": int(g.tokens_per_block), "layer_names": list(g.layer_names)}
            for g in cfg.groups
        ],
        "replicated_layout": bool(cfg.replicated_layout),
        "canonical_layout": bool(cfg.canonical_layout),
        "kv_cache_layout": cfg.kv_cache_layout,
        "worker_kv_bytes_per_block": int(cfg.worker_kv_bytes_per_block),
        "row_stride": int(row_stride),
    }


def _tier_index(offloading_spec, tier_type: str, tier_config: dict) -> int | None:
    """This tier's position in ``secondary_tiers`` (for key paths and the ``tier`` label): the
    entry whose keys, less those the factory consumed, are the ones we were given."""
    entries = getattr(offloading_spec, "secondary_tier_configs", None) or []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or entry.get("type") != tier_type:
            continue
        rest = {k: v for k, v in entry.items() if k not in _FACTORY_KEYS}
        if rest == tier_config:
            return i
    return None


def _json_value(value):
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"{type(value).__name__} is not a configuration value")


def _region(view: memoryview):
    """A flat byte view of vLLM's primary region, an anchor that keeps the buffer exported,
    its base address and its length. Rows are never indexed in Python.

    Like vLLM's ``SecondaryTierManager``, which reads only ``strides[0]`` (the row stride),
    any element format is taken (vLLM passes bytes, its tests float32): kvtier moves whole
    rows of ``strides[0]`` bytes. Refused, with a ``ConfigError``, is only what kvtier cannot
    move rows in: a read-only view (loads write the rows), one that is not C-contiguous (the
    rows are not one span of memory), or one that is not 2-D (no rows)."""
    import ctypes

    wrong = []
    if view.ndim != 2:
        wrong.append(f"it has {view.ndim} dimensions, not 2 (rows, row bytes)")
    if view.readonly:
        wrong.append("it is read-only (loads write into the rows)")
    if not view.c_contiguous:
        wrong.append("it is not C-contiguous (the rows must be one span of memory)")
    if wrong:
        raise _native().ConfigError(
            "primary_kv_view must be a writable C-contiguous 2-D buffer whose rows are "
            f"strides[0] bytes apart: {'; '.join(wrong)} (shape={view.shape}, "
            f"strides={view.strides}, format={view.format!r})"
        )
    flat = view.cast("B")
    anchor = ctypes.c_char.from_buffer(flat)
    return flat, anchor, ctypes.addressof(anchor), flat.nbytes


def _chunk_ids(chunk_ids) -> bytes | None:
    """The job's row ids as int64 little-endian bytes (vLLM's are int32, its tests' int64),
    or None when they are not integers (the job is then reported failed)."""
    import numpy

    ids = numpy.asarray(chunk_ids)
    if ids.size == 0:
        return b""
    if ids.dtype.kind not in "iu":
        return None
    return ids.astype("<i8", copy=False).tobytes()


def _build_class():
    from vllm.v1.kv_offload.base import (
        Locality,
        LookupResult,
        Medium,
        OffloadingCounterMetadata,
        OffloadingEvent,
        OffloadingGaugeMetadata,
        OffloadKey,
        RequestOffloadingContext,
    )
    from vllm.v1.kv_offload.tiering.base import TIER_LABEL, JobResult, SecondaryTierManager

    lookup_results = (LookupResult.MISS, LookupResult.HIT, LookupResult.RETRY)

    class KvtierTier(SecondaryTierManager):
        """kvtier's G3 NVMe tier under vLLM's ``TieringOffloadingManager`` (module docs)."""

        medium = Medium.STORAGE
        tolerates_off_thread_polling = False

        def __init__(
            self,
            offloading_spec,
            primary_kv_view: memoryview,
            tier_type: str,
            backpressure_detector=None,
            locality: str | None = None,
            **tier_config,
        ):
            super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
            self.locality = Locality(locality) if locality is not None else None
            given = dict(tier_config)
            if locality is not None:
                given["locality"] = locality
            index = _tier_index(offloading_spec, tier_type, given)
            if index is None:
                logger.debug("tier entry not found in secondary_tiers; naming keys as index 0")
            self._index = index or 0
            self._label = f"{self._index + 1}:{tier_type}"
            entry = {"type": TIER_CLASS, **given}
            try:
                entry_json = json.dumps(entry, default=_json_value)
            except TypeError as e:
                raise _native().ConfigError(
                    f"secondary_tiers[{self._index}]: {e}"
                ) from None
            self._events = self._events_wanted(offloading_spec, tier_type, given)
            self._flat, anchor, base, length = _region(primary_kv_view)
            spec = spec_fields(offloading_spec, self.block_size_bytes)
            self._counters: dict[tuple[str, tuple[str, ...]], float] = {}
            self._failures_logged_at = 0.0
            self._failures_unlogged = 0
            socket = given.get("service_socket_path")
            if socket is not None:
                # Client mode: the node service owns the G3 pool (docs/node-service.md).
                del anchor
                self._connect(offloading_spec, socket, given, length, spec)
                return
            try:
                self._tier = _native().Tier(
                    base,
                    length,
                    self.block_size_bytes,
                    anchor,
                    entry_json,
                    self._index,
                    json.dumps(spec),
                    self._events,
                )
            except BaseException:
                del anchor
                self._flat.release()
                raise
            del anchor  # the native tier holds it until it has stopped
            logger.info(
                "kvtier tier %s: namespace %s (vLLM digest %s)",
                self._label,
                self._tier.namespace[:16],
                self._tier.vllm_digest,
            )

        def _events_wanted(self, offloading_spec, tier_type, given) -> bool:
            """vLLM's fs tier's rule: events only when the tier's ``enable_kv_events`` and
            vLLM's global KV-events flag are both on (a warning when only the tier's is)."""
            wanted = given.get("enable_kv_events", False)
            if not isinstance(wanted, bool):
                raise _native().ConfigError(
                    f"secondary_tiers[{self._index}].enable_kv_events: expected true or "
                    f"false, found {wanted!r}"
                )
            if not wanted:
                return False
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                return True
            logger.warning(
                "enable_kv_events is set on secondary tier '%s' but KV cache events are "
                "disabled globally; the tier will not emit events.",
                tier_type,
            )
            return False

        def _connect(self, offloading_spec, socket, given, length, spec):
            allowed = {"service_socket_path", "locality", "layout", "enable_kv_events"}
            wrong = sorted(set(given) - allowed)
            if wrong:
                raise _native().ConfigError(
                    f"secondary_tiers[{self._index}].{wrong[0]}: a tier with "
                    "service_socket_path takes only locality, layout and enable_kv_events; "
                    "the node service's "
                    "own configuration holds the nvme keys (docs/node-service.md)"
                )
            layout = given.get("layout")
            if layout is not None and not isinstance(layout, (str, os.PathLike)):
                raise _native().ConfigError(
                    f"secondary_tiers[{self._index}].layout: expected a shipped layout name "
                    f"or a descriptor path, found {layout!r}"
                )
            if not isinstance(socket, (str, os.PathLike)):
                raise _native().ConfigError(
                    f"secondary_tiers[{self._index}].service_socket_path: expected a path, "
                    f"found {type(socket).__name__}"
                )
            engine_id = offloading_spec.config.engine_id
            # vLLM 0.33's scheduler-side SharedOffloadRegion: this file, never unlinked.
            region_path = f"/dev/shm/vllm_offload_{engine_id}.mmap"
            try:
                self._tier = _native().Tier.connect(
                    os.fspath(socket),
                    region_path,
                    length,
                    self.block_size_bytes,
                    json.dumps(spec),
                    str(engine_id),
                    given.get("locality"),
                    None if layout is None else os.fspath(layout),
                    self._index,
                )
            except BaseException:
                self._flat.release()
                raise
            logger.info(
                "kvtier tier %s: client of the node service at %s (namespace %s, region %s)",
                self._label,
                os.fspath(socket),
                self._tier.namespace[:16],
                region_path,
            )

        # ---- lookups and jobs -------------------------------------------------------------

        def lookup(self, key, req_context):
            return lookup_results[self._tier.lookup(key)]

        def touch(self, keys, req_context):
            self._tier.touch(list(keys))

        def submit_store(self, job_metadata):
            # A job kvtier cannot run (a chunk id outside the region, after shutdown) comes
            # back failed from get_finished_jobs, as vLLM's own tiers report it.
            self._tier.submit_store(
                job_metadata.job_id,
                list(job_metadata.keys),
                _chunk_ids(job_metadata.chunk_ids),
            )

        def submit_load(self, job_metadata):
            self._tier.submit_load(
                job_metadata.job_id,
                list(job_metadata.keys),
                _chunk_ids(job_metadata.chunk_ids),
            )

        def get_finished_jobs(self):
            results = []
            for job_id, success, keys, seconds, nbytes, error in self._tier.get_finished_jobs():
                if error is not None:
                    self._log_failure(job_id, error)
                results.append(
                    JobResult(
                        job_id=job_id,
                        success=success,
                        successful_keys=(
                            tuple(OffloadKey(k) for k in keys) if keys and not success else None
                        ),
                        transfer_time=seconds,
                        transfer_bytes=nbytes,
                    )
                )
            return results

        def _log_failure(self, job_id, error):
            # A failing disk fails every job: one line per 10 s with a count, not one per job.
            now = time.monotonic()
            if now - self._failures_logged_at < 10.0:
                self._failures_unlogged += 1
                return
            more = self._failures_unlogged
            self._failures_logged_at, self._failures_unlogged = now, 0
            logger.warning(
                "kvtier tier %s: job %d failed: %s%s",
                self._label,
                job_id,
                error,
                f" ({more} more failed jobs since the last message)" if more else "",
            )

        def has_pending_work(self):
            return self._tier.has_pending_work()

        def take_events(self):
            if not self._events:
                return ()
            # In client mode the node service says which medium holds the keys: its DRAM
            # staging pool (CPU) or G3 (STORAGE).
            return [
                OffloadingEvent(
                    keys=[OffloadKey(k) for k in keys],
                    medium=Medium(medium),
                    removed=removed,
                    locality=self.locality,
                    ownership=self._label,
                    removal_expected=True,
                )
                for keys, removed, medium in self._tier.take_events()
            ]

        def on_new_request(self, req_context):
            # vLLM's KvHintsEnvelope (msgspec) travels as JSON; kvtier reads its own prefetch
            # action (docs/node-service.md) and counts the others.
            hints = getattr(req_context, "kv_hints", None)
            hints_json = None
            if hints is not None:
                import msgspec

                hints_json = msgspec.json.encode(hints).decode()
            self._tier.on_new_request(str(req_context.req_id), hints_json)
            return RequestOffloadingContext()

        def on_request_finished(self, req_context):
            self._tier.on_request_finished(str(req_context.req_id))

        def drain_jobs(self):
            self._tier.drain_jobs()

        def shutdown(self):
            # Raises (keeping the region mapped) if kvtier could not stop its I/O.
            self._tier.shutdown()
            flat, self._flat = self._flat, None
            if flat is not None:
                flat.release()

        # ---- metrics ------------------------------------------------------------------------

        @classmethod
        def build_metric_definitions(cls, extra_config):
            defs = {}
            for name, help_text, kind, labels in _native().metric_descriptors():
                meta = (
                    OffloadingCounterMetadata if kind == "counter" else OffloadingGaugeMetadata
                )
                defs[METRIC_PREFIX + name] = meta(
                    documentation=f"kvtier: {help_text}",
                    labelnames=(TIER_LABEL, *labels),
                )
            return defs

        def get_stats(self):
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
                OffloadingConnectorStats,
            )

            stats = OffloadingConnectorStats()
            for name, kind, labels, value in self._tier.metrics():
                full = METRIC_PREFIX + name
                labelvalues = (self._label, *(v for _, v in labels))
                if kind == "gauge":
                    stats.set_gauge(full, value, labelvalues)
                    continue
                # Counters: vLLM adds what get_stats reports; report what is new.
                key = (full, labelvalues)
                delta = value - self._counters.get(key, 0.0)
                self._counters[key] = value
                if delta > 0:
                    stats.increase_counter(full, delta, labelvalues)
            return None if stats.is_empty() else stats

        @classmethod
        def config_info_keys(cls, tier_config):
            client = "service_socket_path" in (tier_config or {})
            return tuple(_native().config_info_keys(client))

        def config_info(self):
            return dict(self._tier.config_info())

        # ---- for tools and tests ------------------------------------------------------------

        @property
        def ready(self) -> bool:
            """True once kvtier's index is recovered (lookups answer RETRY until then)."""
            return self._tier.ready()

        @property
        def namespace(self) -> str:
            """kvtier's namespace digest (64 hex digits) that the slabs carry."""
            return self._tier.namespace

        @property
        def vllm_digest(self) -> str:
            """vLLM's own FileMapper digest of the same configuration (12 hex digits)."""
            return self._tier.vllm_digest

    KvtierTier.__module__ = __name__
    KvtierTier.__qualname__ = "KvtierTier"
    return KvtierTier
