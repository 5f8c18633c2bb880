"""Building vLLM 0.33.0's own tiering objects for the differential tests.

* :func:`offloading_config`: an ``OffloadingConfig`` for a small synthetic model.
* :class:`ScriptedTier`: an out-of-tree ``SecondaryTierManager`` (loaded by vLLM's own factory
  through ``module_path``) that holds nothing and reports each job when the test says so.
* :func:`tiering_manager`: ``TieringOffloadingSpec(config).get_manager()``: vLLM's spec, its
  back-pressure merge, its factory, its CPU primary over a real shared region, its manager.

Only the secondary tiers are scripted; everything between the test and the tiers is vLLM's.
"""

from __future__ import annotations

import copy

import harness
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager

#: Bytes of one worker's KV per block of the synthetic model: one 4 KiB row per chunk.
ROW_STRIDE = 4096

def offloading_config(extra_config: dict, *, worker_kv_bytes_per_block: int = ROW_STRIDE):
    """vLLM's normalized offloading config for a one-layer, one-worker synthetic model."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layer.0",), group_id=0),),
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        enable_kv_cache_events=False,
        extra_config=extra_config,
        engine_id=harness.engine_id("test"),
        model=OffloadingModelConfig(name="kvtier/replay", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


class ScriptedTier(SecondaryTierManager):
    """Holds nothing; store jobs are recorded and reported when :meth:`finish` says so."""

    medium = Medium.STORAGE

    def __init__(self, offloading_spec, primary_kv_view, tier_type, backpressure_detector=None,
                 **tier_config):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.tier_config = tier_config
        self.submitted = []  # store jobs in submission order
        self._ready = []

    def finish(self, index: int, success: bool, transfer_bytes: int | None) -> None:
        job = self.submitted[index]
        self._ready.append(
            JobResult(job.job_id, success, transfer_time=0.0, transfer_bytes=transfer_bytes)
        )

    def lookup(self, key, req_context):
        return LookupResult.MISS

    def submit_store(self, job_metadata):
        self.submitted.append(job_metadata)

    def submit_load(self, job_metadata):
        self._ready.append(JobResult(job_metadata.job_id, success=False))

    def get_finished_jobs(self):
        ready, self._ready = self._ready, []
        return ready

    def on_new_request(self, req_context):
        return RequestOffloadingContext()

    def drain_jobs(self):
        pass


def scripted_tier_entry(**keys) -> dict:
    """A ``secondary_tiers`` entry vLLM's factory resolves to :class:`ScriptedTier`."""
    return {"type": "ScriptedTier", "module_path": __name__, **keys}


def tiering_manager(extra_config: dict):
    """vLLM's own spec and manager for ``extra_config`` (secondary tiers scripted)."""
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    # vLLM merges the back-pressure dicts into the tier dicts in place: give it a copy.
    spec = TieringOffloadingSpec(offloading_config(copy.deepcopy(extra_config)))
    return spec, spec.get_manager()
