"""``ImageStore``: every image a run saw, once, in MongoDB's own convention for binaries (GridFS bucket ``images``).

An image is a GridFS file whose ``_id`` is the sha256 (hex) of its bytes: ``images.files`` holds
``{_id, length, chunkSize, uploadDate, filename "<sha256>.<ext>", metadata {contentType, width, height}}`` and
``images.chunks`` its bytes in chunks of :data:`CHUNK_BYTES` (``{files_id, n, data}``), exactly as the GridFS spec
lays them out, so Compass, ``mongofiles`` and any driver's GridFS API read them (the tests read them with
PyMongo's ``AsyncGridFSBucket``). Calls and Records reference images by that id; documents stay small.

Writes are idempotent and race-free, which the GridFS upload API is not (a second writer of the same id fails
half-way): the chunks of a given image are a function of its bytes, so each is inserted unless there (a duplicate
key under the unique ``(files_id, n)`` index means another writer stored the identical chunk), and the files
document last, likewise. Invariants:

* a files document exists only after all of its chunks (readers trust the files document alone);
* two samplers storing the same picture at once write identical chunks: whichever lands first stays;
* a writer killed between chunks leaves chunks without a files document (crash window ``images.before_files``):
  invisible to readers, and completed by the next :meth:`ImageStore.put` of that image.

NX-27017 (the embedded server) keeps ``*.files`` and ``*.chunks`` collections in GridFS tables of its own, which take
inserts, finds and deletes but ignore updates and upserts (hence inserts here), report a unique-index conflict as
"UNIQUE constraint failed" without MongoDB's code 11000, replace a files document inserted twice, show a files
document of length 0 for chunks without one (so a files document counts only with the image's length), and store
``uploadDate`` as a string.
"""

from __future__ import annotations

from datetime import UTC, datetime

from bson.binary import Binary
from pymongo import ASCENDING, IndexModel
from pymongo.asynchronous.database import AsyncDatabase
from pymongo.database import Database
from pymongo.errors import DuplicateKeyError, OperationFailure

from agentrl.failpoints import failpoint
from agentrl.vision.images import ImageError, LoadedImage, load_image

BUCKET = "images"
CHUNK_BYTES = 255 * 1024
"""GridFS's default chunk size."""
CHUNK_INDEX = IndexModel([("files_id", ASCENDING), ("n", ASCENDING)], name="files_id_1_n_1", unique=True)
"""GridFS's own index of a bucket's chunks, unique (two writers of one chunk make one document), created by the
first write of a process as drivers create it on a first upload: a run without images has no bucket (NX-27017 makes
GridFS tables of its own for any ``*.chunks`` collection, which generic reads of every collection choke on)."""


class ImageStore:
    """Put and get a run's images by sha256."""

    def __init__(self, db: AsyncDatabase):
        self.files = db[f"{BUCKET}.files"]
        self.chunks = db[f"{BUCKET}.chunks"]
        self._indexed = False

    async def put(self, image: LoadedImage) -> str:
        """Store ``image`` (a no-op if it is there); returns its id, the sha256."""
        stored = await self.files.find_one({"_id": image.sha256})
        if stored is not None and stored.get("length") == len(image.data):
            return image.sha256
        if not self._indexed:
            await self.chunks.create_indexes([CHUNK_INDEX])
            self._indexed = True
        chunks, files = gridfs_documents(image)
        for chunk in chunks:
            await _insert_once(self.chunks.insert_one, chunk)
        failpoint("images.before_files")
        await _insert_once(self.files.insert_one, files)
        return image.sha256

    async def get(self, sha256: str) -> LoadedImage:
        """The image stored under ``sha256``; :class:`ImageError` when it is missing, incomplete or not what its id
        says (bytes of another hash)."""
        files = await self.files.find_one({"_id": sha256})
        parts = [doc["data"] async for doc in self.chunks.find({"files_id": sha256}).sort("n", 1)] if files else []
        return _checked(sha256, files, parts)

    async def get_many(self, ids: list[str]) -> dict[str, LoadedImage]:
        """Each distinct image of ``ids`` by id."""
        return {sha256: await self.get(sha256) for sha256 in dict.fromkeys(ids)}


def read_image_sync(db: Database, sha256: str) -> LoadedImage:
    """:meth:`ImageStore.get` with a synchronous client (the dashboard, ``agentrl export``)."""
    files = db[f"{BUCKET}.files"].find_one({"_id": sha256})
    parts = [doc["data"] for doc in db[f"{BUCKET}.chunks"].find({"files_id": sha256}).sort("n", 1)] if files else []
    return _checked(sha256, files, parts)


def _checked(sha256: str, files: dict | None, parts: list[bytes]) -> LoadedImage:
    if files is None:
        raise ImageError(f"image {sha256}: not in the database (GridFS bucket {BUCKET!r})")
    data = b"".join(parts)
    if len(data) != files["length"]:
        raise ImageError(f"image {sha256}: {len(data)} of its {files['length']} bytes are stored")
    image = load_image(data, f"image {sha256}")
    if image.sha256 != sha256:
        raise ImageError(f"image {sha256}: its stored bytes hash to {image.sha256}")
    return image


def put_images_sync(db: Database, images: list[LoadedImage]) -> None:
    """:meth:`ImageStore.put` of each image, with a synchronous client (``agentrl tasks upload``)."""
    files, chunks = db[f"{BUCKET}.files"], db[f"{BUCKET}.chunks"]
    if images:
        chunks.create_indexes([CHUNK_INDEX])
    for image in {image.sha256: image for image in images}.values():
        stored = files.find_one({"_id": image.sha256})
        if stored is not None and stored.get("length") == len(image.data):
            continue
        chunk_docs, files_doc = gridfs_documents(image)
        for chunk in chunk_docs:
            _unless_duplicate(chunks.insert_one, chunk)
        failpoint("images.before_files")
        _unless_duplicate(files.insert_one, files_doc)


def gridfs_documents(image: LoadedImage) -> tuple[list[dict], dict]:
    """The GridFS chunks and files document of ``image`` (a function of its bytes, but for ``uploadDate``)."""
    chunks = [{"files_id": image.sha256, "n": n, "data": Binary(image.data[start:start + CHUNK_BYTES])}
              for n, start in enumerate(range(0, len(image.data), CHUNK_BYTES))]
    files = {"_id": image.sha256, "length": len(image.data), "chunkSize": CHUNK_BYTES, "uploadDate": datetime.now(UTC),
             "filename": f"{image.sha256}.{image.format.lower()}",
             "metadata": {"contentType": image.mime_type, "width": image.width, "height": image.height}}
    return chunks, files


async def _insert_once(insert, document: dict) -> None:
    """``await insert(document)`` unless another writer inserted the identical one (a unique-key conflict)."""
    try:
        await insert(document)
    except (DuplicateKeyError, OperationFailure) as error:
        _raise_unless_duplicate(error)


def _unless_duplicate(insert, document: dict) -> None:
    try:
        insert(document)
    except (DuplicateKeyError, OperationFailure) as error:
        _raise_unless_duplicate(error)


def _raise_unless_duplicate(error: Exception) -> None:
    if isinstance(error, DuplicateKeyError) or "UNIQUE constraint failed" in str(error):  # NX-27017: no code 11000
        return
    raise error
