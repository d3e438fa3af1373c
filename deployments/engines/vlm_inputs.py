"""A VLM request's messages and images, checked and decoded (the engine's event loop; PIL only, no
MLX): image parts placed, at most `max_images`, each a data URL or a file under an allowed folder,
within `max_image_bytes` and `max_image_pixels`. Every problem is the request's own RequestError."""

import base64
import binascii
import io
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deployments.engine import RequestError

_DATA_URL = re.compile(r"data:image/[\w.+-]+;base64,", re.IGNORECASE)
_ROLES = {"system", "user", "assistant"}


@dataclass(frozen=True)
class ImageInputs:
    """What a request may send: its limits, and the checks and decoding under them."""

    allowed_image_dirs: tuple[Path, ...] = ()
    max_images: int = 8
    max_image_bytes: int = 20 << 20
    max_image_pixels: int = 4096 * 4096

    @classmethod
    def of(cls, allowed_image_dirs: Sequence[str | Path], max_images: int, max_image_bytes: int, max_image_pixels: int) -> "ImageInputs":
        return cls(tuple(Path(d).resolve() for d in allowed_image_dirs), max_images, max_image_bytes, max_image_pixels)

    def messages(self, messages: list[dict], n_images: int) -> list[dict]:
        """Chat messages for the template: image parts become {"type": "image"}; with no image
        part, the images go in front of the last user message's text."""
        if not isinstance(messages, list) or not messages:
            raise RequestError("invalid_request", "messages must be a non-empty list", "messages")
        out, n_parts, has_text = [], 0, False
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in _ROLES:
                raise RequestError("invalid_request", f"messages[{i}] needs a role in {sorted(_ROLES)}", "messages")
            content = m.get("content")
            if isinstance(content, str):
                parts = [{"type": "text", "text": content}]
            elif isinstance(content, list):
                parts = []
                for p in content:
                    kind = p.get("type") if isinstance(p, dict) else None
                    if kind in ("image", "image_url"):
                        parts.append({"type": "image"})
                        n_parts += 1
                    elif kind == "text" and isinstance(p.get("text"), str):
                        parts.append({"type": "text", "text": p["text"]})
                    else:
                        raise RequestError("invalid_request", f"messages[{i}] has an unsupported content part", "messages")
            else:
                raise RequestError("invalid_request", f"messages[{i}].content must be a string or a list", "messages")
            has_text = has_text or any(p.get("text", "").strip() for p in parts)
            out.append({"role": m["role"], "content": parts})
        if n_images > self.max_images:
            raise RequestError("invalid_request", f"at most {self.max_images} image(s) per request", "images")
        if not has_text and not n_images:
            raise RequestError("invalid_request", "the prompt is empty", "messages")
        if n_parts == 0 and n_images:
            users = [m for m in out if m["role"] == "user"]
            if not users:
                raise RequestError("invalid_request", "images need a user message", "messages")
            users[-1]["content"] = [{"type": "image"}] * n_images + users[-1]["content"]
        elif n_parts != n_images:
            raise RequestError("invalid_request", f"{n_parts} image parts but {n_images} images", "images")
        return out

    def image_ref(self, i: int, src: str) -> str | Path:
        """A data URL's base64 payload, or a resolved path under an allowed folder."""
        if not isinstance(src, str):
            raise RequestError("invalid_request", f"images[{i}] must be a string", "images")
        if src[:8].lower().startswith(("http://", "https://")):
            raise RequestError("unsupported", "remote image URLs are disabled", "images")
        if m := _DATA_URL.match(src):
            payload = src[m.end() :]
            if len(payload) * 3 // 4 > self.max_image_bytes:
                raise RequestError("invalid_request", f"images[{i}] is larger than {self.max_image_bytes} bytes", "images")
            return payload
        path = Path(src)
        if not path.is_absolute():
            raise RequestError("invalid_request", f"images[{i}] must be a data:image/...;base64 URL or an allowed file path", "images")
        path = path.resolve()  # symlinks and '..' cannot escape the allowed folders
        if not any(path.is_relative_to(d) for d in self.allowed_image_dirs) or not path.is_file():
            raise RequestError("invalid_request", f"images[{i}] is not a file under an allowed image folder", "images")
        return path

    # ---- images (a worker thread of asyncio's: PIL only, no MLX) ----

    def _decode(self, i: int, ref: str | Path):
        from PIL import Image

        try:
            raw = ref.read_bytes() if isinstance(ref, Path) else base64.b64decode(ref, validate=True)
            if len(raw) > self.max_image_bytes:
                raise RequestError("invalid_request", f"images[{i}] is larger than {self.max_image_bytes} bytes", "images")
            img = Image.open(io.BytesIO(raw))
            if img.width * img.height > self.max_image_pixels:
                raise RequestError("invalid_request", f"images[{i}] has more than {self.max_image_pixels} pixels", "images")
            return img.convert("RGB")
        except (binascii.Error, OSError, ValueError, Image.DecompressionBombError) as e:
            raise RequestError("invalid_request", f"images[{i}] cannot be decoded: {e}", "images") from e

    def decode_all(self, refs: list[str | Path]) -> list[Any]:
        """Every image of a request decoded (RGB), or the RequestError of the first bad one."""
        return [self._decode(i, ref) for i, ref in enumerate(refs)]
