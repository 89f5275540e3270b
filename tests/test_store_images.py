"""``ImageStore`` on a real server (and on SecantusDB under ``--also-secantus``): images stored once by sha256 in
GridFS's layout, read back by PyMongo's own GridFS API, written idempotently by racing writers, completed after a
writer dies between its chunks and its files document, and refused when missing, incomplete or tampered with."""

from __future__ import annotations

import asyncio

import pytest
from gridfs import AsyncGridFSBucket

from agentrl import failpoints
from agentrl.store import Store
from agentrl.store.images import BUCKET, CHUNK_BYTES
from agentrl.vision.images import ImageError, load_image
from inference_fixtures import picture


async def chunk_count(store: Store, files_id: str) -> int:
    """An image's chunks (found by ``files_id``, not counted: NX-27017's GridFS tables answer ``count_documents``
    and projections with "no such column" errors, and an empty filter with nothing)."""
    return len(await store.db[f"{BUCKET}.chunks"].find({"files_id": files_id}).to_list())


async def test_an_image_is_stored_once_in_gridfs_layout(db_uri: str) -> None:
    small, large = load_image(picture(1), "small"), load_image(picture(2, (600, 300)), "large")
    assert len(large.data) > 2 * CHUNK_BYTES  # several chunks
    async with Store(db_uri) as store:
        for image in (small, large, small, large):
            assert await store.images.put(image) == image.sha256
        assert len(await store.db[f"{BUCKET}.files"].find({}).to_list()) == 2
        assert await chunk_count(store, files_id=large.sha256) == \
            -(-len(large.data) // CHUNK_BYTES)
        for image in (small, large):
            assert (await store.images.get(image.sha256)).data == image.data
        bucket = AsyncGridFSBucket(store.db, bucket_name=BUCKET)  # the driver's GridFS reads what we wrote
        stream = await bucket.open_download_stream(large.sha256)
        assert await stream.read() == large.data
        assert stream.filename == f"{large.sha256}.png"
        assert stream.metadata == {"contentType": "image/png", "width": 300, "height": 600}
        assert set(await store.images.get_many([small.sha256, large.sha256, small.sha256])) == {
            small.sha256, large.sha256}


async def test_racing_writers_of_one_image_make_one_copy(db_uri: str) -> None:
    image = load_image(picture(3, (300, 300)), "racing")
    async with Store(db_uri) as store:
        await asyncio.gather(*[store.images.put(image) for _ in range(8)])
        assert len(await store.db[f"{BUCKET}.files"].find({}).to_list()) == 1
        assert await chunk_count(store, image.sha256) == -(-len(image.data) // CHUNK_BYTES)
        assert (await store.images.get(image.sha256)).data == image.data


async def test_a_writer_killed_before_its_files_document(db_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Crash window ``images.before_files``: its chunks are unusable (no files document), the next put of the same
    image completes it."""
    image = load_image(picture(4, (300, 200)), "crash")
    monkeypatch.setenv(failpoints.ENV, "images.before_files")
    failpoints.reset()
    try:
        async with Store(db_uri) as store:
            with pytest.raises(failpoints.FailpointHit):
                await store.images.put(image)
            assert await chunk_count(store, image.sha256) > 0
            # no files document (NX-27017 shows one of length 0)
            with pytest.raises(ImageError, match="not in the database|0 bytes are stored"):
                await store.images.get(image.sha256)
            await store.images.put(image)  # the point fires once: this one completes
            assert (await store.images.get(image.sha256)).data == image.data
            assert await chunk_count(store, image.sha256) == -(-len(image.data) // CHUNK_BYTES)
    finally:
        monkeypatch.delenv(failpoints.ENV)
        failpoints.reset()


async def test_missing_incomplete_or_tampered_images_are_refused(db_uri: str) -> None:
    image = load_image(picture(5, (300, 300)), "tampered")
    other = load_image(picture(6), "other")
    async with Store(db_uri) as store:
        with pytest.raises(ImageError, match="not in the database"):
            await store.images.get("0" * 64)
        await store.images.put(image)
        chunks = store.db[f"{BUCKET}.chunks"]
        await chunks.delete_one({"files_id": image.sha256, "n": 1})
        with pytest.raises(ImageError, match="bytes are stored"):
            await store.images.get(image.sha256)
        await store.images.put(other)
        # another image's bytes under its id (deleted and inserted: NX-27017's GridFS tables ignore updates)
        files = store.db[f"{BUCKET}.files"]
        document = await files.find_one({"_id": other.sha256})
        await chunks.delete_many({"files_id": other.sha256})
        await files.delete_one({"_id": other.sha256})
        await chunks.insert_one({"files_id": other.sha256, "n": 0, "data": picture(7)})
        await files.insert_one({**document, "length": len(picture(7))})
        with pytest.raises(ImageError, match="hash to"):
            await store.images.get(other.sha256)
