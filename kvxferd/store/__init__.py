"""The offload tier (seed 003): a request's KV and Mamba/GDN state in host DRAM and files, in a
canonical, versioned format, found again by chained token-prefix hashes.

Layer 4 beside the transport: it reads and writes the engine's mapped regions with numpy and
plain file I/O. NIXL's POSIX backend does work on these machines (probed: a DRAM<->FILE WRITE
and READ of 1 MiB through ``nixl_agent(backends=[]) + create_backend("POSIX")`` verified), but
the store does not use it: every entry must pass its checksums *before* a byte reaches engine
memory, and the canonical layout (per head, token-major) is a permutation of the engine's kernel
blocks, so a file can never be read straight into registered blocks; reads go to a staging buffer
either way, where ``readinto`` is as fast and needs no registration (and the store stays free of
the transport's NIXL agent).

Modules: :mod:`keys` (chunk hashes), :mod:`canonical` (the format's byte order, fingerprints,
gather/scatter), :mod:`format` (entry header and checksums), :mod:`coverage` (which entries
serve which TP units), :mod:`pool` (reusable, reference-counted entry buffers), :mod:`tiers`
(DRAM pool, file directory), :mod:`store` (save, lookup with the minimum-prefix rule, load).

Sliding-window groups keep only the chunks whose blocks the engine still holds (-1 marks a block
that left the window); a prefix is served when its window, the ``sliding_window`` tokens before
the next token, is stored. Not stored yet: Mamba states other than the one at the end of a saved
request (vLLM's align mode keeps one per block; the API would take them as extra state blocks).
"""

from kvxferd.store.keys import chunk_keys, chunk_spans
from kvxferd.store.store import LoadOutcome, LookupOutcome, SaveOutcome, Store

__all__ = [
    "LoadOutcome",
    "LookupOutcome",
    "SaveOutcome",
    "Store",
    "chunk_keys",
    "chunk_spans",
]
