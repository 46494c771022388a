"""Test fixtures shared by the tests and benchmarks: tiny model builders, images,
the tokenizer, and a server process runner."""
