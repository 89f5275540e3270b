"""SGLang's distributed weight update against a real ``agentrl engine``, driven the way slime and verl drive SGLang:
the test is the trainer. It builds the weight-update group with its own copy of SGLang's recipe
(``init_custom_process_group`` of sglang 0.5.23: rendezvous, ``PrefixStore(group_name, store)``,
``_new_process_group_helper``; pinned in tests/contracts/sglang_api.json), sends SGLang's request bodies with plain
HTTP inside SGLang 0.5.23's weight-update session (``/begin_weight_update`` ... ``/end_weight_update``) while it
broadcasts from rank 0, per tensor and as SGLang's flattened ``uint8`` buckets, and then compares the
engine's logprobs with those of the same weights loaded from disk: bit-identical. Bad updates (a tensor the model
does not have, a group whose peer never joins, a version left half-sent) leave the engine serving its previous
weights, with SGLang's ``{success, message}`` and 400."""

from __future__ import annotations

import asyncio
import base64
import datetime
import io
import json
import os
import pickle
import socket
import sys
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from agentrl.inference import SGLangClient, tensor_payload, weight_sync
from inference_fixtures import start_engine

pytestmark = pytest.mark.slow

FACTS = json.loads((Path(__file__).parent / "contracts" / "sglang_api.json").read_text())
CONTRACT, SESSION = FACTS["weight_update_group"], FACTS["weight_update_session"]
GROUP = "weight_update_group"
PROMPT = [1, 5, 9, 14, 3, 27, 8]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def sglang_group(port: int, world_size: int, group_name: str = GROUP, timeout_s: float = 60.0
                 ) -> torch.distributed.ProcessGroup:
    """Rank 0 of a weight-update group, made as SGLang's ``init_custom_process_group`` makes it (a trainer's copy,
    not AgentRL's code)."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    assert CONTRACT["process_group"] == {"prefix_store_prefix": "group_name", "rendezvous": True,
                                         "helper": "_new_process_group_helper"}
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend("gloo"), PrefixStore(group_name, store),
                                         group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


class Call(threading.Thread):
    """An HTTP POST that answers only once the collective it starts is done: run while rank 0 takes part."""

    def __init__(self, url: str, path: str, body: dict[str, Any]):
        super().__init__(daemon=True)
        self.url, self.path, self.body = url, path, body
        self.response: httpx.Response | None = None
        self.start()

    def run(self) -> None:
        self.response = httpx.post(self.url + self.path, json=self.body, timeout=120)

    def result(self) -> tuple[int, dict[str, Any]]:
        self.join(120)
        assert self.response is not None, f"{self.path} did not answer"
        return self.response.status_code, self.response.json()


def join(url: str, world_size: int = 2, group_name: str = GROUP) -> torch.distributed.ProcessGroup:
    port = _free_port()
    call = Call(url, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                                     "rank_offset": 1, "world_size": world_size,
                                                     "group_name": group_name, "backend": "gloo"})
    group = sglang_group(port, world_size, group_name)
    assert call.result() == (200, {"success": True, "message": "Succeeded to initialize custom process group."})
    return group


def update(url: str, group: torch.distributed.ProcessGroup, named: list[tuple[str, torch.Tensor]], *,
           bucket: bool, version: str | None = None) -> tuple[int, dict[str, Any]]:
    """One ``/update_weights_from_distributed`` with SGLang's body, rank 0 broadcasting as slime does."""
    body: dict[str, Any] = {"names": [n for n, _ in named], "dtypes": [str(t.dtype).removeprefix("torch.")
                                                                      for _, t in named],
                            "shapes": [list(t.shape) for _, t in named], "group_name": GROUP, "flush_cache": True}
    assert set(body) <= set(CONTRACT["update_request"])
    if version is not None:
        body["weight_version"] = version
    if bucket:
        body["load_format"] = "flattened_bucket"
    call = Call(url, "/update_weights_from_distributed", body)
    if bucket:  # SGLang's FlattenedTensorBucket: the bytes in order, as uint8
        flat = torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for _, t in named])
        torch.distributed.broadcast(flat, src=0, group=group)
    else:
        for _, tensor in named:
            torch.distributed.broadcast(tensor.detach().contiguous(), src=0, group=group)
    return call.result()


@contextmanager
def session(url: str) -> Iterator[None]:
    """SGLang's weight-update session around the updates of the block (its bodies, as the contract has them)."""
    begin = httpx.post(url + "/begin_weight_update", json={"selector": "all"}, timeout=30)
    assert begin.json() == {"success": True, "message": "Success"}
    try:
        yield
    finally:
        end = httpx.post(url + "/end_weight_update", json={}, timeout=30)
        assert end.json() == {"success": True, "message": "Success"}


def logprobs(url: str) -> tuple[list[float], str]:
    reply = httpx.post(url + "/generate", json={"input_ids": PROMPT, "return_logprob": True,
                                                "sampling_params": {"temperature": 0, "max_new_tokens": 6}},
                       timeout=60).json()
    return [entry[0] for entry in reply["meta_info"]["output_token_logprobs"]], reply["meta_info"]["weight_version"]


def parameters(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    return list(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):
    process = start_engine(tiny_model_dir, "--weight_update_timeout_s", "10")
    yield process.url
    process.stop()


def test_a_trainer_written_for_sglang_updates_the_engine_per_tensor_and_bucketed(
        engine: str, tiny_model_dir: Path, tiny_model_b_dir: Path) -> None:
    base, _ = logprobs(engine)
    new = parameters(tiny_model_b_dir)
    group = join(engine)
    try:
        with session(engine):
            assert update(engine, group, new, bucket=False, version="7")[0] == 200
        per_tensor, version = logprobs(engine)
        assert version == "7" and per_tensor != base
        with session(engine):
            assert update(engine, group, parameters(tiny_model_dir), bucket=True, version="8")[0] == 200
            assert logprobs(engine) == (base, "8")
            half = len(new) // 2  # two buckets, as slime sends them: the version applies after the second
            status, first = update(engine, group, new[:half], bucket=True, version="9")
            assert status == 200 and "staged" in first["message"] and logprobs(engine) == (base, "8")
            status, second = update(engine, group, new[half:], bucket=True, version="9")
            assert status == 200 and second["message"].startswith("Succeeded to update model weights")
        bucketed, version = logprobs(engine)
        assert version == "9"
    finally:
        reply = httpx.post(engine + "/destroy_weights_update_group", json={"group_name": GROUP}, timeout=30)
        torch.distributed.destroy_process_group(group)
    assert reply.json() == {"success": True, "message": "Succeeded to destroy custom process group."}
    loaded = httpx.post(engine + "/update_weights_from_disk", json={"model_path": str(tiny_model_b_dir),
                                                                   "weight_version": "10"}, timeout=120)
    assert loaded.status_code == 200
    from_disk, _ = logprobs(engine)
    assert per_tensor == bucketed == from_disk  # bit-identical to the disk path


def test_in_memory_updates_need_a_session_as_in_sglang(engine: str, tiny_model_b_dir: Path) -> None:
    """SGLang 0.5.23 refuses ``/update_weights_from_distributed`` outside ``/begin_weight_update`` ...
    ``/end_weight_update``, opens one session at a time and ends none that is not open; so does the engine."""
    assert "/update_weights_from_distributed" in SESSION["required_by"]
    assert set(SESSION["begin_request"]) - {"rid", "http_worker_ipc"} == {"selector"} and \
        set(SESSION["end_request"]) <= {"rid", "http_worker_ipc"}
    before = logprobs(engine)
    name, tensor = parameters(tiny_model_b_dir)[0]
    outside = httpx.post(engine + "/update_weights_from_distributed", json={
        "names": [name], "dtypes": ["float32"], "shapes": [list(tensor.shape)], "group_name": GROUP,
        "weight_version": "40"}, timeout=30)  # refused before any broadcast is awaited
    assert outside.status_code == 400 and outside.json()["message"] == (
        "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()")
    assert logprobs(engine) == before
    with session(engine):
        twice = httpx.post(engine + "/begin_weight_update", json={}, timeout=30)
        assert twice.status_code == 400 and "already open" in twice.json()["message"]
    unopened = httpx.post(engine + "/end_weight_update", json={}, timeout=30)
    assert unopened.status_code == 400 and "no weight-update session is open" in unopened.json()["message"]
    assert set(unopened.json()) == set(SESSION["response_keys"]["/end_weight_update"])


def test_bad_updates_change_nothing(engine: str, tiny_model_dir: Path, tiny_model_b_dir: Path) -> None:
    httpx.post(engine + "/update_weights_from_disk", json={"model_path": str(tiny_model_dir),
                                                           "weight_version": "20"}, timeout=120)
    before = logprobs(engine)
    new = parameters(tiny_model_b_dir)
    group = join(engine)
    with session(engine):
        try:
            renamed = [("model.layers.0.mlp.not_a_weight", new[0][1]), *new[1:]]
            status, reply = update(engine, group, renamed, bucket=False, version="21")
            assert status == 400 and reply["success"] is False
            assert "model.layers.0.mlp.not_a_weight: the served model has no such parameter" in reply["message"]
            assert logprobs(engine) == before
            status, reply = update(engine, group, new[:3], bucket=True, version="22")  # a version left half-sent
            assert status == 200 and "staged" in reply["message"]
        finally:
            httpx.post(engine + "/destroy_weights_update_group", json={"group_name": GROUP}, timeout=30)
            torch.distributed.destroy_process_group(group)
        assert logprobs(engine) == before  # destroying the group dropped the staged part
        again = httpx.post(engine + "/destroy_weights_update_group", json={"group_name": GROUP}, timeout=30)
        assert again.status_code == 400 and "does not exist" in again.json()["message"]
        nowhere = httpx.post(engine + "/update_weights_from_distributed", json={
            "names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[4, 4]], "group_name": "nope"}, timeout=30)
        assert nowhere.status_code == 400
        assert "Please call `init_weights_update_group` first" in nowhere.json()["message"]
    refused = httpx.post(engine + "/init_weights_update_group", json={
        "master_address": "127.0.0.1", "master_port": _free_port(), "rank_offset": 1, "world_size": 2}, timeout=30)
    assert refused.status_code == 400 and "backend nccl needs CUDA" in refused.json()["message"]  # SGLang's default
    invalid = httpx.post(engine + "/init_weights_update_group", json={
        "master_address": "127.0.0.1", "master_port": 80, "rank_offset": 2, "world_size": 2}, timeout=30)
    assert invalid.status_code == 400  # rank_offset outside the group


def sglang_serialized(obj: Any) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)``: torch's ``ForkingPickler``, base64."""
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode()


def shared(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors in shared memory another process can map by name (as a trainer on this host keeps them)."""
    return [(name, tensor_payload.share_for_sending(tensor.detach().clone())) for name, tensor in named]


def sglang_class(module: str, name: str, monkeypatch: pytest.MonkeyPatch) -> type:
    """A class pickled under SGLang's name (``module.name``), as a trainer with SGLang installed sends it."""
    cls = type(name, (), {"__init__": lambda self, **fields: self.__dict__.update(fields)})
    cls.__module__ = module
    parts = module.split(".")
    for depth in range(1, len(parts) + 1):  # pickle imports the module: its packages must be there too
        monkeypatch.setitem(sys.modules, ".".join(parts[:depth]),
                            sys.modules.get(".".join(parts[:depth])) or types.ModuleType(".".join(parts[:depth])))
    setattr(sys.modules[module], name, cls)
    return cls


def test_a_trainer_on_this_host_hands_over_shared_tensors_direct_and_bucketed(
        engine: str, tiny_model_dir: Path, tiny_model_b_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``/update_weights_from_tensor`` with SGLang's payloads, its own classes in them: a list of ``(name,
    tensor)`` (some wrapped in ``LocalSerializedTensor``, one pickle per rank, as verl sends them) and a flattened
    bucket with ``FlattenedTensorMetadata``; the engine copies the tensors, and serves what a disk load serves."""
    local = sglang_class("sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor",
                         monkeypatch)
    meta = sglang_class("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata", monkeypatch)
    httpx.post(engine + "/update_weights_from_disk", json={"model_path": str(tiny_model_dir),
                                                           "weight_version": "50"}, timeout=120)
    base = logprobs(engine)
    new = shared(parameters(tiny_model_b_dir))
    wrapped = [(name, local(values=[base64.b64decode(sglang_serialized(tensor))]) if i % 2 else tensor)
               for i, (name, tensor) in enumerate(new)]
    assert set(CONTRACT["tensor_request"]) >= {"serialized_named_tensors", "load_format", "weight_version"}
    with session(engine):
        direct = httpx.post(engine + "/update_weights_from_tensor", json={
            "serialized_named_tensors": [sglang_serialized(wrapped)], "weight_version": "51"}, timeout=120)
    assert direct.status_code == 200 and direct.json()["success"], direct.text
    from_tensors = logprobs(engine)
    assert from_tensors[1] == "51" and from_tensors[0] != base[0]
    for _, tensor in new:
        tensor.zero_()  # the sender's memory changes after the answer: the engine kept its own copy
    assert logprobs(engine) == from_tensors

    old = parameters(tiny_model_dir)
    flat = tensor_payload.share_for_sending(torch.cat([t.detach().reshape(-1).view(torch.uint8) for _, t in old]))
    metadata, offset = [], 0
    for name, tensor in old:
        size = tensor.numel() * tensor.element_size()
        metadata.append(meta(name=name, shape=tensor.shape, dtype=tensor.dtype, start_idx=offset,
                             end_idx=offset + size, numel=size))
        offset += size
    with session(engine):
        bucket = httpx.post(engine + "/update_weights_from_tensor", json={
            "serialized_named_tensors": [sglang_serialized({"flattened_tensor": flat, "metadata": metadata})],
            "load_format": "flattened_bucket", "weight_version": "52"}, timeout=120)
    assert bucket.status_code == 200 and bucket.json()["success"], bucket.text
    assert logprobs(engine) == (base[0], "52")
    loaded = httpx.post(engine + "/update_weights_from_disk", json={"model_path": str(tiny_model_b_dir),
                                                                   "weight_version": "51"}, timeout=120)
    assert loaded.status_code == 200 and logprobs(engine) == from_tensors  # bit-identical to the disk path


class _Gadget:
    """A pickle that runs a shell command when unpickled by an unrestricted unpickler."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_tensor_payload_that_would_run_code_is_refused_and_changes_nothing(engine: str, tmp_path: Path) -> None:
    before = logprobs(engine)
    marker = tmp_path / "pwned"
    with session(engine):
        for payload in ([("lm_head.weight", _Gadget(marker))], _Gadget(marker)):
            refused = httpx.post(engine + "/update_weights_from_tensor", json={
                "serialized_named_tensors": [base64.b64encode(pickle.dumps(payload)).decode()]}, timeout=30)
            assert refused.status_code == 400 and "system is not allowed" in refused.json()["message"], refused.text
        garbage = httpx.post(engine + "/update_weights_from_tensor", json={
            "serialized_named_tensors": ["not base64!"]}, timeout=30)
        assert garbage.status_code == 400 and "not base64" in garbage.json()["message"]
        two_ranks = httpx.post(engine + "/update_weights_from_tensor", json={
            "serialized_named_tensors": ["", ""]}, timeout=30)
        assert two_ranks.status_code == 400 and "one per tensor-parallel rank" in two_ranks.json()["message"]
    assert not marker.exists() and logprobs(engine) == before


def test_a_peer_that_never_joins_times_out_and_the_engine_serves_on(engine: str) -> None:
    """A group of three (trainer, engine, a server that never comes): the engine's join fails after its
    --weight_update_timeout_s (10 s here) with SGLang's message, and it keeps serving."""
    before = logprobs(engine)
    port = _free_port()
    call = Call(engine, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                                       "rank_offset": 1, "world_size": 3, "group_name": "lonely",
                                                       "backend": "gloo"})
    failed: list[BaseException] = []

    def trainer() -> None:
        try:
            sglang_group(port, 3, "lonely", timeout_s=10)
        except Exception as error:  # noqa: BLE001 - the trainer's side times out too
            failed.append(error)

    rank0 = threading.Thread(target=trainer, daemon=True)
    rank0.start()
    status, reply = call.result()
    rank0.join(60)
    assert status == 400 and reply["message"].startswith("Failed to initialize custom process group")
    assert failed, "the trainer's join must time out too"
    assert logprobs(engine) == before


async def test_agentrls_client_and_sender_update_the_engine(engine: str, tiny_model_dir: Path,
                                                            tiny_model_b_dir: Path) -> None:
    """The same through AgentRL's side (the trainer's): ``SGLangClient``'s calls and ``weight_sync``'s group and
    per-dtype buckets."""
    httpx.post(engine + "/update_weights_from_disk", json={"model_path": str(tiny_model_dir),
                                                           "weight_version": "30"}, timeout=120)
    port = _free_port()
    new = parameters(tiny_model_b_dir)
    async with SGLangClient(engine) as client:
        joined = asyncio.create_task(client.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo"))
        group = await asyncio.to_thread(weight_sync.init_group, "127.0.0.1", port, 0, 2, GROUP, "gloo", 60)
        await joined
        try:
            flat, layout = weight_sync.flatten(new)
            await client.begin_weight_update()
            sent = asyncio.create_task(client.update_weights_from_distributed(
                [s.name for s in layout], [weight_sync.dtype_name(s.dtype) for s in layout],
                [list(s.shape) for s in layout], weight_version=31, load_format=weight_sync.BUCKET_FORMAT))
            await asyncio.to_thread(torch.distributed.broadcast, flat, 0, group)
            assert (await sent).success
            await client.end_weight_update()
        finally:
            await client.destroy_weights_update_group()
            weight_sync.destroy_group(group)
    ours = logprobs(engine)
    httpx.post(engine + "/update_weights_from_disk", json={"model_path": str(tiny_model_b_dir),
                                                           "weight_version": "31"}, timeout=120)
    assert ours == logprobs(engine) and ours[1] == "31"
