"""The model runtime shared by the prefill and decode roles.

Owns model definitions, weight loading, tokenization, the paged KV cache, the scheduler and the
sampler. Must not know about networks, routers or the store: roles move KV bytes in and out
through `KVBlockIO` (see `engine.kv_cache`).
"""
