"""Weights in memory, the trainer's side: buckets gathered one at a time, broadcast to each service's group.

**Buckets** (:func:`parameter_buckets`, every rank): the model's parameters in order (tied ones once), each gathered
from its FSDP2/TP shards (``full_tensor``: a collective), converted to the publish dtype on the device, grouped into
buckets of one dtype and at most ``limit_bytes`` (a larger tensor goes alone). Rank 0 gets the buckets; the other
ranks take part in the gathers and get nothing. Rank 0 holds at most one bucket of gathered weights beyond the
model itself, plus the send buffer: one bucket, kept for the run (a buffer used again faults in no new pages: on
the CPU this halves the time to flatten a bucket). A LoRA model is merged first, which needs its whole state on
rank 0 (as the disk export).

**Groups** (:class:`WeightGroups`, rank 0): one SGLang weight-update group per inference service, world size 2
(this process rank 0, the service rank 1), made the first time a publish reaches the service and kept for the run.
One group per service, not one for all: a service that dies or restarts breaks only its own group. A service that
cannot join (an SGLang without the endpoint, a failed rendezvous) gets its weights through disk; the reason is
logged once.

**A send** (:meth:`WeightGroups.send`): each service first gets ``POST /begin_weight_update`` (SGLang 0.5.23 refuses
in-memory updates outside such a session; a service without the endpoint, 404, is not asked again), then for each
bucket ``POST /update_weights_from_distributed`` (SGLang's body, ``load_format: flattened_bucket``, the version)
while rank 0 broadcasts the bucket in its group; a service's answer for a bucket comes before the next bucket goes.
The engine stages buckets and swaps when the last one arrived (all or nothing); its answer to the last one (after
the swap), then ``POST /end_weight_update``, are awaited by the publish's announcement. A broadcast or an answer
that fails, or takes longer than ``timeout_s``, drops the service's group (the next publish makes a new one; the
service is asked to end its session) and the service gets this version through disk.

**Tensors on this host** (:class:`TensorSender`, ``--weight_transport tensor``): no group and no copy through a
socket. Each bucket is flattened into a send buffer the services can map (shared memory on the CPU, CUDA IPC on a
GPU: :mod:`agentrl.inference.tensor_payload`) and every service on this host gets ``POST
/update_weights_from_tensor`` naming it, inside the same session; all must answer (they copy it) before the next
bucket overwrites the buffer. A service on another host, or without the endpoint, gets files.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from torch import nn

from agentrl.failpoints import failpoint
from agentrl.inference import tensor_payload, weight_sync
from agentrl.training import lora
from agentrl.training.aio import LoopThread
from agentrl.training.parallel import ParallelState

logger = logging.getLogger(__name__)

POLL_S = 0.002
_WRAPPERS = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")

Bucket = list[tuple[str, torch.Tensor]]


def parameter_buckets(model: nn.Module, parallel: ParallelState, *, dtype: torch.dtype, device: torch.device,
                      limit_bytes: int) -> Iterator[Bucket]:
    """The model's parameters in buckets (rank 0; the other ranks iterate through the gathers and get none)."""
    bucket: Bucket = []
    size = 0
    for name, tensor in _full_parameters(model, parallel):
        if not parallel.is_main:
            continue
        tensor = tensor.detach().to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and (bucket[-1][1].dtype != tensor.dtype or size + nbytes > limit_bytes):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _full_parameters(model: nn.Module, parallel: ParallelState) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter by its Hugging Face name, gathered (full on rank 0); a LoRA model's merged weights."""
    from torch.distributed.tensor import DTensor

    if lora.is_adapted(model):
        from agentrl.training.weights import full_state_dict

        state = full_state_dict(model, parallel)
        if parallel.is_main:
            yield from lora.merge_state_dict(model, state).items()
        return
    for name, param in model.named_parameters():  # the same order on every rank; tied parameters once
        full = param.full_tensor() if isinstance(param, DTensor) else param
        for wrapper in _WRAPPERS:
            name = name.replace(wrapper, "")
        yield name, full


def local_address(base_url: str) -> str:
    """The address of this host that ``base_url``'s host reaches it by (loopback for a local service): the
    address a weight-update group's rank 0 gives as ``master_address``."""
    host = urlsplit(base_url).hostname or "127.0.0.1"
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).is_loopback:
            return "127.0.0.1"
    if host == "localhost":
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent: only the route is chosen
        probe.connect((host, 9))
        return probe.getsockname()[0]


def _free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


@dataclass
class _Member:
    group: dist.ProcessGroup
    name: str
    sessions: bool = True  # the service has /begin_weight_update (SGLang before 0.5.23 has not)


@dataclass
class SendResult:
    """Rank 0's outcome of one send: the services' answers to the last bucket (awaited by the announcement) and
    the services whose transfer failed (base URL -> error)."""

    last: dict[str, Future] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)


class WeightGroups:
    """Rank 0's weight-update groups, one per inference service, kept for the run."""

    def __init__(self, io: LoopThread, *, backend: str, timeout_s: float, address: str | None = None):
        self.io, self.backend, self.timeout_s, self.address = io, backend, timeout_s, address
        self.members: dict[str, _Member] = {}
        self.refused: dict[str, str] = {}  # base URL -> why it could not join last time (logged once)
        self.unable: dict[str, str] = {}  # base URL -> why it never can (it has no such endpoint): not asked again
        self._buffer = SendBuffer()

    async def join(self, base_url: str) -> str | None:
        """Make ``base_url``'s group unless it exists; the reason when the service cannot join (None: joined)."""
        from agentrl.inference.client import InferenceServiceError, SGLangClient

        if base_url in self.members:
            return None
        if base_url in self.unable:
            return self.unable[base_url]
        address = self.address or local_address(base_url)
        port = _free_port(address)
        name = f"agentrl-{uuid.uuid4().hex[:12]}"
        joined = asyncio.wrap_future(_in_daemon_thread(weight_sync.init_group, address, port, 0, 2, name,
                                                        self.backend, self.timeout_s))
        try:
            async with SGLangClient(base_url, max_retries=0, admin_timeout_s=self.timeout_s + 30) as client:
                await client.init_weights_update_group(address, port, 1, 2, group_name=name, backend=self.backend)
            group = await asyncio.wait_for(joined, self.timeout_s + 30)
        except (InferenceServiceError, OSError, RuntimeError, TimeoutError) as error:
            # rank 0's rendezvous, if still waiting, ends at its timeout in its (daemon) thread
            reason = f"cannot join a weight-update group: {error}"
            if self.refused.get(base_url) != reason:
                logger.warning("inference service %s %s", base_url, reason)
            self.refused[base_url] = reason
            if isinstance(error, InferenceServiceError) and error.status_code == 404:  # no such endpoint: not again
                self.unable[base_url] = reason
            return reason
        self.refused.pop(base_url, None)
        self.members[base_url] = _Member(group, name)
        logger.info("inference service %s joined weight-update group %s (%s, rank 0 at %s:%d)", base_url, name,
                    self.backend, address, port)
        return None

    def drop(self, base_url: str) -> None:
        """Forget a service's group (broken, or the service is gone); both ends are destroyed in the background."""
        member = self.members.pop(base_url, None)
        if member is not None:
            threading.Thread(target=_destroy_quietly, args=(member.group,), daemon=True).start()
            self.io.submit(self._leave(base_url, member.name))

    async def _leave(self, base_url: str, group_name: str) -> None:
        """Ask the service to destroy its end of a dropped group (it may be gone: then nothing is left to do)."""
        from agentrl.inference.client import InferenceServiceError, SGLangClient

        await _end_session(base_url, 30, quiet=True)  # a session the failed send left open (if any)
        async with SGLangClient(base_url, max_retries=0, admin_timeout_s=30) as client:
            with contextlib.suppress(InferenceServiceError, OSError):
                await client.destroy_weights_update_group(group_name)

    def send(self, buckets: Iterator[Bucket], urls: list[str], version: int) -> SendResult:
        """Broadcast every bucket to the services ``urls`` (main thread; every one joined); see the module doc."""
        result = SendResult()
        active = [url for url in urls if url in self.members]
        answers: dict[str, Future] = {}
        for index, bucket in enumerate(buckets):
            flat, layout = weight_sync.flatten(bucket, self._buffer.for_bucket(bucket))
            for url in list(active):
                error = self._send_bucket(url, flat, layout, version, answers, begin=index == 0)
                if error is not None:
                    active.remove(url)
                    result.failures[url] = error
                    self.drop(url)
            if index == 0:
                failpoint("publish.distributed.after_first_bucket")
        result.last = {url: self.io.submit(self._end(url, answers[url])) for url in active}
        return result

    def _send_bucket(self, url: str, flat: torch.Tensor, layout: list[weight_sync.TensorSpec], version: int,
                     answers: dict[str, Future], *, begin: bool) -> str | None:
        """One bucket to one service: its HTTP call (after opening the session: ``begin``) and the broadcast; the
        error text if either fails. The service's answer to the previous bucket is awaited first; the answer to this
        one is left in ``answers``."""
        member = self.members[url]
        previous = answers.pop(url, None)
        if previous is not None:
            error = _answer_error(previous, self.timeout_s)
            if error is not None:
                return error
        call = self.io.submit(self._update(url, member, layout, version, begin=begin))
        work = dist.broadcast(flat, src=0, group=member.group, async_op=True)
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():
            if call.done() and call.exception() is not None:
                return f"the service refused the update: {call.exception()}"
            if time.monotonic() > deadline:
                return f"broadcasting {flat.numel() / 2**20:.0f} MiB took longer than {self.timeout_s:g} s"
            time.sleep(POLL_S)
        try:
            work.wait()
        except RuntimeError as error:
            return f"the broadcast failed: {error}"
        answers[url] = call
        return None

    async def _update(self, url: str, member: _Member, layout: list[weight_sync.TensorSpec], version: int, *,
                      begin: bool) -> None:
        from agentrl.inference.client import SGLangClient

        async with SGLangClient(url, max_retries=0, admin_timeout_s=self.timeout_s + 1800) as client:
            if begin and member.sessions:
                member.sessions = await _open_session(client)
            await client.update_weights_from_distributed(
                [s.name for s in layout], [weight_sync.dtype_name(s.dtype) for s in layout],
                [list(s.shape) for s in layout], group_name=member.name, weight_version=version,
                load_format=weight_sync.BUCKET_FORMAT)

    async def _end(self, url: str, last: Future) -> None:
        """The service's answer to the last bucket (its swap), then the end of its session."""
        await asyncio.wait_for(asyncio.wrap_future(last), self.timeout_s)
        member = self.members.get(url)
        if member is not None and member.sessions:
            await _end_session(url, self.timeout_s)

    def close(self) -> None:
        for url in list(self.members):
            self.drop(url)
        self._buffer = SendBuffer()


class SendBuffer:
    """A publish's send buffer: kept for the run, grown to the largest bucket, on the bucket's device; ``shared``:
    in memory another process on this host can map (:func:`agentrl.inference.tensor_payload.share_for_sending`)."""

    def __init__(self, *, shared: bool = False):
        self.shared = shared
        self._buffer: torch.Tensor | None = None

    def for_bucket(self, bucket: Bucket) -> torch.Tensor:
        size = sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
        device = bucket[0][1].device
        if self._buffer is None or self._buffer.numel() < size or self._buffer.device != device:
            self._buffer = None  # freed before the larger one is made
            buffer = torch.empty(size, dtype=torch.uint8, device=device)
            self._buffer = tensor_payload.share_for_sending(buffer) if self.shared else buffer
        return self._buffer


class TensorSender:
    """Rank 0's in-memory publish to services on this host (``POST /update_weights_from_tensor``); the interface of
    :class:`WeightGroups`."""

    def __init__(self, io: LoopThread, *, timeout_s: float):
        self.io, self.timeout_s = io, timeout_s
        self.members: dict[str, bool] = {}  # base URL -> whether it has weight-update sessions
        self.unable: dict[str, str] = {}  # base URL -> why it cannot take tensors (logged once, not asked again)
        self._buffer = SendBuffer(shared=True)

    async def join(self, base_url: str) -> str | None:
        """Whether ``base_url`` can take tensors from this host; the reason when not (None: it can)."""
        if base_url in self.unable:
            return self.unable[base_url]
        if not on_this_host(base_url):
            return self._unable(base_url, "is on another host: tensors are shared only with services on this one")
        self.members.setdefault(base_url, True)
        return None

    def _unable(self, base_url: str, reason: str) -> str:
        logger.warning("inference service %s %s; it gets the weights from disk", base_url, reason)
        self.members.pop(base_url, None)
        self.unable[base_url] = reason
        return reason

    def drop(self, base_url: str) -> None:
        """Forget a service (its transfer failed, or it is gone); it is asked to end its session."""
        if self.members.pop(base_url, None):
            self.io.submit(_end_session(base_url, 30, quiet=True))

    def send(self, buckets: Iterator[Bucket], urls: list[str], version: int) -> SendResult:
        """Hand every bucket to the services ``urls`` (main thread; each joined): each answers a bucket before the
        next one overwrites the buffer; ``last`` holds the ends of their sessions."""
        from agentrl.inference.client import InferenceServiceError

        result = SendResult()
        active = [url for url in urls if url in self.members]
        for index, bucket in enumerate(buckets):
            if not active:
                continue  # the other ranks' gathers go on: every bucket is still taken
            try:
                buffer = self._buffer.for_bucket(bucket)
            except RuntimeError as error:  # shared memory full (a container's /dev/shm: --shm-size)
                size = sum(t.numel() * t.element_size() for _, t in bucket) / 2**20
                reason = f"cannot share a {size:.0f} MiB bucket ({error}); /dev/shm may be too small"
                logger.warning("publishing weights version %d: %s", version, reason)
                result.failures.update(dict.fromkeys(active, reason))
                for url in active:
                    self.drop(url)
                active = []
                continue
            flat, layout = weight_sync.flatten(bucket, buffer)
            payload = tensor_payload.serialize_bucket(flat, layout)
            calls = {url: self.io.submit(self._update(url, payload, version, begin=index == 0)) for url in active}
            for url, call in calls.items():
                error = _answer_error(call, self.timeout_s)
                if error is None:
                    continue
                active.remove(url)
                result.failures[url] = error
                refusal = call.exception() if call.done() else None
                if isinstance(refusal, InferenceServiceError) and refusal.status_code == 404:
                    self._unable(url, "has no /update_weights_from_tensor")
                self.drop(url)
        result.last = {url: self.io.submit(self._end(url)) for url in active}
        return result

    async def _end(self, url: str) -> None:
        """The end of the service's session (its swap came with its answer to the last bucket)."""
        if self.members.get(url):
            await _end_session(url, self.timeout_s)

    async def _update(self, url: str, payload: str, version: int, *, begin: bool) -> None:
        from agentrl.inference.client import SGLangClient

        async with SGLangClient(url, max_retries=0, admin_timeout_s=self.timeout_s) as client:
            if begin and self.members.get(url):
                self.members[url] = await _open_session(client)
            await client.update_weights_from_tensor([payload], weight_version=version,
                                                    load_format=weight_sync.BUCKET_FORMAT)

    def close(self) -> None:
        for url in list(self.members):
            self.drop(url)


def on_this_host(base_url: str) -> bool:
    """Whether ``base_url``'s host is this machine (loopback, or the address this machine reaches it by)."""
    host = urlsplit(base_url).hostname or "127.0.0.1"
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    return ipaddress.ip_address(address).is_loopback or address == local_address(base_url)


async def _end_session(base_url: str, timeout_s: float, *, quiet: bool = False) -> None:
    """``POST /end_weight_update`` (``quiet``: after a failure, the service may be gone or hold no session)."""
    from agentrl.inference.client import InferenceServiceError, SGLangClient

    try:
        async with SGLangClient(base_url, max_retries=0, admin_timeout_s=timeout_s) as client:
            await client.end_weight_update()
    except (InferenceServiceError, OSError):
        if not quiet:
            raise


async def _open_session(client) -> bool:
    """``POST /begin_weight_update``; whether the service has sessions (False: 404, an SGLang before 0.5.23). A
    session a failed publish left open is closed and opened again."""
    from agentrl.inference.client import InferenceRequestError

    try:
        await client.begin_weight_update()
    except InferenceRequestError as error:
        if error.status_code == 404:
            return False
        if "already open" not in str(error):
            raise
        await client.end_weight_update()
        await client.begin_weight_update()
    return True


def _in_daemon_thread(function, *args) -> Future:
    """``function(*args)`` in a daemon thread (a rendezvous nobody comes to must not hold up the process's exit)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(function(*args))
        except BaseException as error:  # noqa: BLE001 - handed to the waiter
            future.set_exception(error)

    threading.Thread(target=run, daemon=True, name="weight-group-rendezvous").start()
    return future


def _answer_error(call: Future, timeout_s: float) -> str | None:
    try:
        call.result(timeout=timeout_s)
    except TimeoutError:
        return f"the service did not answer within {timeout_s:g} s"
    except Exception as error:  # noqa: BLE001 - the service's refusal, reported by name
        return f"the service refused the update: {error}"
    return None


def _destroy_quietly(group: dist.ProcessGroup) -> None:
    with contextlib.suppress(Exception):
        weight_sync.destroy_group(group)
