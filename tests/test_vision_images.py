"""Images as they enter AgentRL (``agentrl.vision.images``): decodable pictures within the limits or a clear error
naming the source, URLs and paths refused, one repair (broken ancillary PNG chunks) and no other; and MCP tool
results' pictures from the MCP project's reference server (npm), taken as images or as notes."""

from __future__ import annotations

import asyncio
import base64
import io
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, UnidentifiedImageError

from agentrl.tools import ToolManager
from agentrl.tools.errors import ToolConnectionError
from agentrl.vision.images import (
    MAX_IMAGE_BYTES,
    PNG_SIGNATURE,
    ImageError,
    decode_image_string,
    load_image,
    without_broken_ancillary_chunks,
)


def png(size: tuple[int, int] = (12, 16), mode: str = "RGB", **save) -> bytes:
    out = io.BytesIO()
    if mode == "RGB":
        Image.fromarray(np.random.default_rng(0).integers(0, 255, (*size, 3), dtype=np.uint8)).save(out, "PNG", **save)
    else:
        Image.new(mode, size[::-1]).save(out, "PNG", **save)
    return out.getvalue()


def chunks(data: bytes) -> list[tuple[bytes, int, int]]:
    """``(type, start, end)`` of each chunk of a PNG."""
    out, pos = [], len(PNG_SIGNATURE)
    while pos < len(data):
        length = int.from_bytes(data[pos:pos + 4], "big")
        out.append((data[pos + 4:pos + 8], pos, pos + 12 + length))
        pos += 12 + length
    return out


def with_chunk(data: bytes, kind: bytes, body: bytes, *, good_crc: bool) -> bytes:
    """``data`` with a chunk inserted after IHDR (its CRC right or wrong)."""
    crc = zlib.crc32(kind + body) ^ (0 if good_crc else 1)
    chunk = len(body).to_bytes(4, "big") + kind + body + crc.to_bytes(4, "big")
    ihdr_end = chunks(data)[0][2]
    return data[:ihdr_end] + chunk + data[ihdr_end:]


def test_pictures_are_loaded_with_their_hash_and_size() -> None:
    data = png((12, 16))
    image = load_image(data, "here")
    assert (image.format, image.width, image.height, image.mime_type) == ("PNG", 16, 12, "image/png")
    assert image.rgb.size == (16, 12) and image.data == data
    assert decode_image_string(image.data_uri(), "uri").sha256 == image.sha256
    assert decode_image_string(base64.b64encode(data).decode(), "bare").sha256 == image.sha256
    jpeg = io.BytesIO()
    Image.new("RGB", (8, 8)).save(jpeg, "JPEG")
    assert load_image(jpeg.getvalue(), "jpeg").mime_type == "image/jpeg"


@pytest.mark.parametrize(("data", "fragment"), [
    (b"", "the image is empty"),
    (b"GIF89a but not really", "not an image"),
    (png()[:60], "the image cannot be decoded"),
    (png((10000, 10000), mode="1"), "10000x10000 pixels, more than the 89,478,485 allowed"),
    (b"\x89PNG" + bytes(MAX_IMAGE_BYTES), "more than the 20,971,520 allowed"),
])
def test_what_is_not_a_usable_picture_is_refused_naming_its_source(data: bytes, fragment: str) -> None:
    with pytest.raises(ImageError, match=f"^tool result 3: .*{fragment}"):
        load_image(data, "tool result 3")


@pytest.mark.parametrize(("text", "fragment"), [
    ("https://example.com/cat.png", "not as URLs or paths"),
    ("file:///etc/passwd", "not as URLs or paths"),
    ("/etc/passwd", "not as URLs or paths"),
    ("../secret.png", "not as URLs or paths"),
    ("data:image/png,rawbytes", "must be base64"),
    ("data:application/pdf;base64,JVBERi0=", "declares application/pdf"),
    ("not base64 at all!", "not valid base64"),
])
def test_images_given_as_text_are_data_uris_or_base64_only(text: str, fragment: str) -> None:
    with pytest.raises(ImageError, match=fragment):
        decode_image_string(text, "image_data[0]")


def test_a_broken_ancillary_chunk_is_dropped_and_nothing_else_is_repaired() -> None:
    """A PNG whose colour profile (iCCP, ancillary) fails its CRC loads without it, as browsers show it; a failing
    critical chunk (the pixels) stays an error, and a sound PNG is left alone."""
    good = png()
    broken = with_chunk(good, b"tEXt", b"Comment\x00hello", good_crc=False)
    with pytest.raises(UnidentifiedImageError):  # PIL refuses it whole (a broken chunk checksum)
        Image.open(io.BytesIO(broken)).load()
    repaired = load_image(broken, "broken")
    assert repaired.data == good and repaired.rgb.tobytes() == load_image(good, "good").rgb.tobytes()
    assert without_broken_ancillary_chunks(good) is None
    assert load_image(with_chunk(good, b"tEXt", b"Comment\x00hi", good_crc=True), "sound").data != good  # kept
    idat = next((start, end) for kind, start, end in chunks(good) if kind == b"IDAT")
    damaged = bytearray(good)
    damaged[idat[0] + 8 + 2:idat[0] + 8 + 12] = bytes(10)  # the compressed pixels themselves
    assert without_broken_ancillary_chunks(bytes(damaged)) is None  # a critical chunk: no repair
    with pytest.raises(ImageError, match="cannot be decoded"):
        load_image(bytes(damaged), "damaged")


def test_mcp_image_results_from_the_reference_server(everything_server_entry: Path) -> None:
    """server-everything's ``get-tiny-image``: with images its PNG comes back as a picture (repaired: its iCCP
    checksum is broken) and the text has no note; without, the text notes it, as before; the config's ``tools``
    offers only the tools it names, and a name the server lacks is an error."""
    from scripted_vision_model import everything_config

    config = everything_config(everything_server_entry)

    async def run() -> None:
        async with ToolManager(config) as tools:
            assert [spec["function"]["name"] for spec in tools.openai_tools()] == ["get-tiny-image"]
            seen = await tools.call_tool("get-tiny-image", {}, images=True)
            assert seen.ok and [(i.format, i.width, i.height) for i in seen.images] == [("PNG", 20, 20)]
            assert "omitted" not in seen.text and "MCP logo" in seen.text
            noted = await tools.call_tool("get-tiny-image", {})
            assert noted.images == [] and "[image content (image/png) omitted]" in noted.text
        wrong = config.model_copy(deep=True)
        wrong.servers[0].tools = ["get-tiny-image", "no-such-tool"]
        with pytest.raises(ToolConnectionError, match="has no tool 'no-such-tool'.*it lists: .*echo"):
            async with ToolManager(wrong):
                pass

    asyncio.run(run())
