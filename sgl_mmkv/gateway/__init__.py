"""The image-affinity gateway: a small reverse proxy in front of SGLang's router that
sets ``X-SMG-Routing-Key`` from each request's images on the server side
(``python -m sgl_mmkv.gateway``; docs/deployment.md, "With the router"). Built on
aiohttp (SGLang's own dependency)."""
