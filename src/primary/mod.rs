//! The CPU primary tier: slots over the primary region's rows, ref counts and eviction.
