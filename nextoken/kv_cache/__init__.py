"""The paged KV cache, in one place.

- `block_pool`: fixed-size blocks with reference counts, an LRU free queue and block hashes
  (prefix caching);
- `manager`: each request's block table (and sliding-window ring), allocation and freeing;
- `tensors`: the key/value tensors themselves (`PagedKVCache`, `SlidingKVCache`), written and read
  by the attention layers through the block tables.

The scheduler decides with `manager` which blocks a step uses; the model runner hands the
tensors to the model.
"""
