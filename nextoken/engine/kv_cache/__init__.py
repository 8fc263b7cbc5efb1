"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, block tables, prefix caching.

Only ids and counts live here; the key/value tensors are in `nextoken.runner.kv_cache`.
"""
