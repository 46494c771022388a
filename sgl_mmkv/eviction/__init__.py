"""Importance-scored survival of visual tokens under memory pressure.

Eviction scorers rank the tokens of each cached image segment by how much keeping
them is worth (AirCache, MM-ShiftKV, SnapKV); under memory pressure the segment
store keeps each segment's top ``--mm-kv-budget`` fraction and frees the rest
before whole segments go by LRU (``SegmentStore.compress_lru``).
"""
