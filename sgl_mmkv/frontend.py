"""SGLang frontend backend for multi-image programs.

Stock ``sglang.RuntimeEndpoint`` (0.5.23) asserts ``"Only support one image."``
when an ``sgl.function`` holds more than one ``sgl.image``, although the server's
``/generate`` takes a list of images. :class:`RuntimeEndpoint` sends them all, in
prompt order, and is otherwise the stock class::

    import sglang as sgl
    from sgl_mmkv.frontend import RuntimeEndpoint

    sgl.set_default_backend(RuntimeEndpoint("http://127.0.0.1:30000"))
"""

from __future__ import annotations

from typing import Any

from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint as _StockRuntimeEndpoint


class RuntimeEndpoint(_StockRuntimeEndpoint):
    """``sglang.RuntimeEndpoint`` that sends every image of the program."""

    def _add_images(self, s: Any, data: dict) -> None:
        images = [base64_data for _path, base64_data in s.images_]
        if len(images) == 1:
            data["image_data"] = images[0]
        elif images:
            data["image_data"] = images
