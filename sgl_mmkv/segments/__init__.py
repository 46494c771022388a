"""The segment store (image KV owned by sgl_mmkv, keyed by content) and the index that
classes each request's image items as prefix hits, reusable or new."""
