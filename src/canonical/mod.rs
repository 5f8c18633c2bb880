//! The canonical KV layout: descriptors, per-rank mappings, tiling checks, digests, gather/scatter.
