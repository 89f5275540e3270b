"""`agentrl tasks upload`: validation with FILE:LINE errors, nothing inserted on error, idempotence, aliases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pymongo import MongoClient

from cli_helpers import agentrl
from inference_fixtures import picture


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def tasks(db_uri: str) -> list[dict]:
    client = MongoClient(db_uri)
    try:
        return list(client.get_default_database().Task.find({}, sort=[("order", 1)]))
    finally:
        client.close()


def test_upload_accepts_aliases_and_is_idempotent(db_uri: str, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [
        {"id": "a", "query": "1+1?", "answer": "2", "scorer": "math", "answer_schema": "boxed"},
        {"Question": "Capital of France?", "Final answer": "Paris", "level": 3},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2*3?"}],
         "expected_answer": 6, "system_prompt": "You are a calculator."},
        {"q": "odd?", "raw": {"expected_answer": "no"}, "task_id": 7},
    ])
    first = agentrl("tasks", "upload", str(path), "--db_connection_string", db_uri, "--num_generations", "4")
    assert first.returncode == 0, first.stderr
    assert "inserted 4 tasks" in first.stdout
    stored = tasks(db_uri)
    assert [t["query"] for t in stored] == ["1+1?", "Capital of France?", "2*3?", "odd?"]
    assert [t["answer"] for t in stored] == ["2", "Paris", "6", "no"]
    assert stored[0]["_id"] == "train:a" and stored[3]["_id"] == "train:7"
    assert stored[0]["scorer"] == "math" and stored[1]["scorer"] == "agentcpm"
    assert stored[1]["metadata"] == {"level": 3} and stored[2]["system_prompt"] == "You are a calculator."
    assert all(t["num_generations"] == 4 and t["unclaimed"] == 4 and t["status"] == "created" for t in stored)
    second = agentrl("tasks", "upload", str(path), "--db_connection_string", db_uri, "--num_generations", "4")
    assert second.returncode == 0 and "inserted 0 tasks" in second.stdout and "4 already present" in second.stdout
    assert len(tasks(db_uri)) == 4
    other_split = agentrl("tasks", "upload", str(path), "--db_connection_string", db_uri, "--split", "test")
    assert other_split.returncode == 0 and "inserted 4 tasks" in other_split.stdout
    test_tasks = [t for t in tasks(db_uri) if t["split"] == "test"]
    assert len(test_tasks) == 4 and all(t["num_generations"] == 1 for t in test_tasks)


def test_invalid_lines_are_all_reported_and_nothing_is_inserted(db_uri: str, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [
        {"id": "ok", "query": "fine", "answer": "1"},
        "{not json",
        {"id": "noq", "answer": "1"},
        {"id": "schema", "query": "x", "answer": "1", "answer_schema": "xml"},
        {"id": "noans", "query": "x", "scorer": "math"},
        [1, 2],
        {"id": "gen", "query": "x", "answer": "1", "num_generations": 0},
    ])
    result = agentrl("tasks", "upload", str(path), "--db_connection_string", db_uri)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith(str(path))]
    assert [e.split(":")[1] for e in errors] == ["2", "3", "4", "5", "6", "7"]
    assert "invalid JSON" in errors[0] and "no question" in errors[1] and "'answer_schema'" in errors[2]
    assert "no answer" in errors[3] and "expected a JSON object" in errors[4] and "num_generations" in errors[5]
    assert "nothing was inserted" in result.stderr
    assert tasks(db_uri) == []
    skipping = agentrl("tasks", "upload", str(path), "--db_connection_string", db_uri, "--skip_invalid")
    assert skipping.returncode == 0 and "inserted 1 tasks" in skipping.stdout and "6 invalid skipped" in skipping.stdout
    assert [t["_id"] for t in tasks(db_uri)] == ["train:ok"]


def test_json_array_errors_name_the_line_and_duplicates_are_caught(db_uri: str, tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text('[\n  {"id": 1, "question": "a", "answer": "1"},\n  {"id": 2, "question": "b"},\n'
                    '  {"id": 1, "question": "changed", "answer": "1"}\n]\n')
    result = agentrl("tasks", "upload", str(path), "--db_connection_string", db_uri)
    assert result.returncode != 0
    assert f"{path}:3: no answer" in result.stderr
    assert f"{path}:4: duplicate id '1' (first at line 2)" in result.stderr
    missing = agentrl("tasks", "upload", str(tmp_path / "missing.jsonl"), "--db_connection_string", db_uri)
    assert missing.returncode != 0 and "no such file" in missing.stderr
    assert tasks(db_uri) == []


def test_content_hash_ids_make_unnamed_tasks_idempotent(db_uri: str, tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps([{"question": "a", "answer": "1"}, {"question": "b", "answer": "2"}]))
    assert agentrl("tasks", "upload", str(path), "--db_connection_string", db_uri).returncode == 0
    assert agentrl("tasks", "upload", str(path), "--db_connection_string", db_uri).returncode == 0
    stored = tasks(db_uri)
    assert len(stored) == 2 and all(t["_id"] == f"train:{t['content_hash']}" for t in stored)


def test_task_images_are_checked_then_stored_once_in_gridfs(db_uri: str, tmp_path: Path) -> None:
    """``images``: files relative to the task file or data: URIs; every bad one is reported with its line and item
    and nothing is written; good ones are stored once (GridFS) before the Tasks that name them by sha256."""
    import base64
    import hashlib

    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(picture(1))
    (tmp_path / "pics" / "b.jpg").write_bytes(picture(2, kind="JPEG"))
    (tmp_path / "pics" / "notes.txt").write_text("not a picture")
    (tmp_path / "pics" / "cut.png").write_bytes(picture(3)[:100])
    uri = "data:image/png;base64," + base64.b64encode(picture(4)).decode()
    bad = write_jsonl(tmp_path / "bad.jsonl", [
        {"id": "ok", "query": "What is shown?", "answer": "noise", "images": ["pics/a.png"]},
        {"id": "missing", "query": "q", "answer": "a", "images": ["pics/none.png"]},
        {"id": "text", "query": "q", "answer": "a", "images": ["pics/a.png", "pics/notes.txt"]},
        {"id": "cut", "query": "q", "answer": "a", "images": ["pics/cut.png"]},
        {"id": "shape", "query": "q", "answer": "a", "images": "pics/a.png"},
        {"id": "uri", "query": "q", "answer": "a", "images": ["data:image/png;base64,@@"]},
    ])
    result = agentrl("tasks", "upload", str(bad), "--db_connection_string", db_uri)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith(str(bad))]
    assert [e.split(":")[1] for e in errors] == ["2", "3", "4", "5", "6"]
    assert "'images[0]': cannot read" in errors[0] and "none.png" in errors[0]
    assert "'images[1]' (pics/notes.txt): not an image" in errors[1]
    assert "'images[0]' (pics/cut.png): the image cannot be decoded" in errors[2]
    assert "expected a list of image file paths or data: URIs" in errors[3]
    assert "'images[0]': not valid base64" in errors[4]
    client = MongoClient(db_uri)
    try:
        db = client.get_default_database()
        assert tasks(db_uri) == [] and db["images.files"].find_one({}) is None  # nothing written

        good = write_jsonl(tmp_path / "good.jsonl", [
            {"id": "one", "query": "What is shown?", "answer": "noise", "images": ["pics/a.png", "pics/b.jpg"]},
            {"id": "two", "query": "And here?", "answer": "noise", "images": [uri, "pics/a.png"]},
            {"id": "plain", "query": "1+1?", "answer": "2"},
        ])
        for _ in range(2):
            assert agentrl("tasks", "upload", str(good), "--db_connection_string", db_uri).returncode == 0
        sha = {name: hashlib.sha256(data).hexdigest()
               for name, data in (("a", picture(1)), ("b", (tmp_path / "pics" / "b.jpg").read_bytes()),
                                  ("uri", picture(4)))}
        stored = {t["_id"]: t for t in tasks(db_uri)}
        assert stored["train:one"]["images"] == [sha["a"], sha["b"]]
        assert stored["train:two"]["images"] == [sha["uri"], sha["a"]]
        assert stored["train:plain"]["images"] == []
        files = {doc["_id"]: doc for doc in db["images.files"].find({})}
        assert set(files) == set(sha.values())
        assert files[sha["b"]]["metadata"]["contentType"] == "image/jpeg"
    finally:
        client.close()


def test_an_upload_killed_between_an_images_chunks_and_its_files_document(db_uri: str, tmp_path: Path) -> None:
    """Crash window ``images.before_files``, the process killed there (``exit``): no Task is inserted (they come
    after their images), the picture is not readable, and the same upload again completes both."""
    import asyncio
    import hashlib

    from agentrl.store import Store
    from agentrl.vision.images import ImageError

    (tmp_path / "big.png").write_bytes(picture(3, (600, 300)))  # several chunks
    path = write_jsonl(tmp_path / "t.jsonl", [{"id": "p", "query": "q?", "answer": "a", "images": ["big.png"]}])
    sha = hashlib.sha256((tmp_path / "big.png").read_bytes()).hexdigest()

    async def read() -> bytes:
        async with Store(db_uri) as store:
            return (await store.images.get(sha)).data

    killed = agentrl("tasks", "upload", str(path), "--db_connection_string", db_uri,
                     env={"AGENTRL_FAILPOINTS": "images.before_files=exit"})
    assert killed.returncode == 86, killed.stderr
    assert tasks(db_uri) == []
    with pytest.raises(ImageError):
        asyncio.run(read())
    again = agentrl("tasks", "upload", str(path), "--db_connection_string", db_uri)
    assert again.returncode == 0 and "inserted 1 tasks" in again.stdout, again.stderr
    assert asyncio.run(read()) == (tmp_path / "big.png").read_bytes()
    assert [t["images"] for t in tasks(db_uri)] == [[sha]]
