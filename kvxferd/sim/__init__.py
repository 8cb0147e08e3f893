"""The simulated engine behind ``kvxferd sim``: an OpenAI-compatible server whose paged KV pool
lives in shared memory and moves between prefill and decode through real kvxferd sidecars.

Modules: tokens (tokenizer/sampler stand-ins), blocks (free list, prefix cache), kvpool (per-rank
shm pools), digest (TP-independent hash of a request's KV bytes), children/sidecars (child
processes with ready lines), transfer_params (vLLM's P/D params), pulls, engine, protocol, app,
server.
"""
