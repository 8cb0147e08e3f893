"""HTTP edges of the sidecar: the engine API (Unix socket) and the peer API (TCP)."""
