"""Selective refresh of reused image KV: scoring, selection (and, later, execution)."""
