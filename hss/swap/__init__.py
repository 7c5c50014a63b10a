"""High-speed swap: scratch pool, predictor-driven eviction, backing stores, streamed exact attention (SPEC §7-§8)."""
