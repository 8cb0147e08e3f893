"""The fault campaign's parts: targets (sidecar pair, sims), fault kinds, invariant checks."""
