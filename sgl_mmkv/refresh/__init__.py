"""The forward of a refresh batch: plan, copy and re-position reused image KV, score
and select, recompute, then the forward-time instruments (the observer and ranker of
scored eviction, decode-time compression) and the segment fill."""
