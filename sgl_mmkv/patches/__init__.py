"""HookRegistry patches of SGLang internals, one file per target.

Each module names the SGLang function it patches and the version it was written
against (0.5.23), and registers its hook from a ``register()`` function that the
plugin calls. No module here is imported by a stock server.
"""
