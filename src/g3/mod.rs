//! The G3 NVMe tier: preallocated slab files whose slots are exactly one primary row.
