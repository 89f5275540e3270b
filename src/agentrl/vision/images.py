"""Images as AgentRL receives, checks, addresses and hands them on: bytes, their sha256 and a decoded picture.

Every image that enters the system (a task file's ``images``, an MCP tool's ``ImageContent``, an environment's
observation, a request to ``agentrl engine``) goes through :func:`load_image` once: it must be a picture PIL can
decode completely (PNG, JPEG, WebP, GIF's first frame, BMP, ...), at most :data:`MAX_IMAGE_BYTES` bytes and
:data:`MAX_IMAGE_PIXELS` pixels (the decompression-bomb bound, refused rather than warned about). Anything else is
an :class:`ImageError` naming where it came from and what was wrong. An image is known by the sha256 of its bytes
(:attr:`LoadedImage.sha256`): the key under which it is stored once (GridFS), cached by the engine and referenced
from every call that used it.

One repair is made, as browsers make it: a PNG whose *ancillary* chunks (colour profile, text, time: chunks that do
not hold pixels) fail their checksum is kept without those chunks (:func:`without_broken_ancillary_chunks`). The
MCP project's own reference server returns such a PNG (its ``get-tiny-image`` logo has a broken ``iCCP`` checksum),
which PIL refuses whole. A critical chunk that fails, or a truncated file, is still an error.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import zlib
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL import Image

MAX_IMAGE_BYTES = 20 * 1024 * 1024
"""The largest encoded image accepted (OpenAI's limit for an image input)."""
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_IMAGE_PIXELS = 89_478_485
"""The most pixels (width x height) an image may have: PIL's decompression-bomb threshold, where PIL only warns."""

_DATA_URI = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,",
                       re.ASCII)


class ImageError(ValueError):
    """An image that cannot be used; the message names its source and the reason."""


@dataclass(frozen=True)
class LoadedImage:
    """An image's encoded bytes, their sha256 (hex) and its decoded format and size."""

    data: bytes
    sha256: str
    format: str  # PIL's name: PNG, JPEG, WEBP, ...
    width: int
    height: int

    @property
    def mime_type(self) -> str:
        return f"image/{self.format.lower()}"

    @cached_property
    def rgb(self) -> Image.Image:
        """The picture as an RGB image (decoded again from the bytes on first use)."""
        from PIL import Image

        with Image.open(io.BytesIO(self.data)) as image:
            return image.convert("RGB")

    def data_uri(self) -> str:
        """The image as a ``data:`` URI (what an OpenAI ``image_url`` part or SGLang's ``image_data`` carries),
        encoded once: every LLM call of a trajectory sends its pictures again."""
        return self._data_uri

    @cached_property
    def _data_uri(self) -> str:
        return f"data:{self.mime_type};base64,{base64.b64encode(self.data).decode('ascii')}"


def without_broken_ancillary_chunks(data: bytes) -> bytes | None:
    """A PNG's bytes without its ancillary chunks whose CRC fails; None when it is no PNG, has no such chunk, or
    is malformed otherwise (a critical chunk fails, or the chunks run past the end)."""
    if not data.startswith(PNG_SIGNATURE):
        return None
    out, pos, dropped = bytearray(PNG_SIGNATURE), len(PNG_SIGNATURE), False
    while pos + 12 <= len(data):
        length = int.from_bytes(data[pos:pos + 4], "big")
        end = pos + 12 + length
        if end > len(data):
            return None
        kind, body, crc = data[pos + 4:pos + 8], data[pos + 8:end - 4], data[end - 4:end]
        if zlib.crc32(kind + body).to_bytes(4, "big") != crc:
            if not kind[:1].islower():  # a critical chunk (upper-case first letter): the pixels are damaged
                return None
            dropped = True
        else:
            out += data[pos:end]
        pos = end
        if kind == b"IEND":
            break
    return bytes(out) if dropped else None


def load_image(data: bytes, source: str) -> LoadedImage:
    """Check that ``data`` is one whole decodable image within the limits; ``source`` names it in errors (a task
    file's line and field, a tool call, a request's ``image_data[2]``). A PNG with broken ancillary chunks comes
    back without them (see the module doc): its ``data`` and ``sha256`` are those of the repaired bytes."""
    try:
        return _load(data, source)
    except ImageError:
        repaired = without_broken_ancillary_chunks(data)
        if repaired is None:
            raise
    return _load(repaired, source)


def _load(data: bytes, source: str) -> LoadedImage:
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ImageError(f"{source}: the image is empty (0 bytes)")
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"{source}: the image has {len(data):,} bytes, more than the {MAX_IMAGE_BYTES:,} allowed")
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height, kind = image.width, image.height, image.format
            if width * height > MAX_IMAGE_PIXELS:
                raise ImageError(f"{source}: the image has {width}x{height} pixels, more than the "
                                 f"{MAX_IMAGE_PIXELS:,} allowed")
            image.load()  # decodes every byte: a truncated or corrupt file fails here, not later in a model
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError(f"{source}: not an image (PIL recognises no image format in its {len(data):,} bytes)") \
            from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise ImageError(f"{source}: the image cannot be decoded ({error})") from None
    if width < 1 or height < 1:
        raise ImageError(f"{source}: the image has no pixels ({width}x{height})")
    return LoadedImage(data=data, sha256=hashlib.sha256(data).hexdigest(), format=kind or "PNG",
                       width=width, height=height)


def decode_image_string(text: str, source: str) -> LoadedImage:
    """An image given as text: a ``data:`` URI with base64 content, or bare base64 (as SGLang's ``image_data``
    takes it). URLs and file paths are refused: an engine or sampler reads no file and fetches nothing it is told
    to."""
    stripped = text.strip()
    match = _DATA_URI.match(stripped)
    if match:
        if not match.group("b64"):
            raise ImageError(f"{source}: a data: URI of an image must be base64 (';base64,')")
        if match.group("mime") and not match.group("mime").startswith("image/"):
            raise ImageError(f"{source}: the data: URI declares {match.group('mime')}, not an image type")
        payload = stripped[match.end():]
    elif re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*://", stripped) or stripped.startswith(("/", "./", "../", "~")):
        raise ImageError(f"{source}: images are taken as data: URIs or base64, not as URLs or paths "
                         f"({stripped[:60]!r})")
    else:
        payload = stripped
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{source}: not valid base64 ({len(payload):,} characters)") from None
    return load_image(data, source)
