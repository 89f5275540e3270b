"""Weight publishing: write the trainer's weights, have every live inference service load them, bump the version.

Order for version ``v`` (the run's ``policy_version`` + 1): the weights go to ``output_dir/weights/<v>`` (complete
before anyone sees the name), every live ``InferenceService`` gets ``POST /update_weights_from_disk`` with that
path and ``weight_version = "v"`` (all services at once; transient failures retried; nothing is aborted: our engine
swaps between two decoding steps and its running requests go on with ``v``, each token keeping the version that
sampled it; SGLang finishes its running requests with the old weights first), then ``Run.policy_version`` becomes
``v``. A service that still fails is reported by name and counted, and keeps serving its old version, whose tokens
stay stamped with it, so staleness accounting stays right. Only the last ``keep`` weight directories are kept.

:meth:`WeightPublisher.publish` does it all and waits. Its three parts serve a trainer that goes on training while
the services load (``--overlap_publish``): :meth:`~WeightPublisher.export` (every rank: the weights and the
probe's expected logprobs; the model may change after it), :meth:`~WeightPublisher.announce` (rank 0, on the io
loop: loads, probe, bump) and :meth:`~WeightPublisher.finish` (every rank, once the announcement is done: pruning
and a barrier).

With ``adapter=True`` (``--lora_publish adapter``) ``weights/<v>`` is the PEFT adapter alone (a few MB), every
live service gets ``POST /load_lora_adapter`` with the name ``policy-v<v>`` (a name left by a crashed publish of
the same version is unloaded and loaded again), and the bump records that name on the Run: samplers then name it
in each request and stamp its tokens with ``v`` (SGLang's ``weight_version`` does not change with adapters). The
adapters of pruned versions are unloaded in the background: unloading waits for the requests still using them.

With a :class:`ProbeSettings`, every service that loaded the version is then checked before the bump
(:mod:`agentrl.training.policy_probe`): it scores a fixed sequence, and one whose logprobs are not the trainer's is
reported by name and kept off the samplers. Publishes reach the services that are UP or STARTING (an engine
loading the run's weights as it joins), whatever their last check said.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from agentrl.failpoints import failpoint
from agentrl.inference.protocol import policy_adapter_name
from agentrl.store import Store, VersionConflict
from agentrl.store.models import PolicyProbe
from agentrl.training.aio import LoopThread
from agentrl.training.parallel import ParallelState
from agentrl.training.policy_probe import check_service, trainer_logprobs
from agentrl.training.weight_transport import SendResult, TensorSender, WeightGroups, parameter_buckets
from agentrl.training.weights import export_adapter, export_pretrained

logger = logging.getLogger(__name__)


class PublishError(RuntimeError):
    """The run's policy version moved under the trainer (another trainer publishes to the same run?)."""


@dataclass(frozen=True)
class ProbeSettings:
    """The policy probe after each publish: the token ids every service scores and the largest mean |served −
    trainer| logprob difference it may show."""

    token_ids: list[int]
    max_mean_abs_diff: float


@dataclass
class PublishResult:
    version: int
    path: Path | None  # the weight files written for this version (None: every service got it in memory)
    services: int = 0
    in_memory: int = 0  # services that got it through their weight-update group
    failures: dict[str, str] = field(default_factory=dict)  # service base URL -> error
    probes: dict[str, PolicyProbe] = field(default_factory=dict)  # service base URL -> its check (when probed)
    seconds: float = 0.0  # from the export to the bump
    # of ``seconds``: gathering and sending or writing the weights; the services' loads or swaps;
    # the policy probe (the trainer's forward pass and the services' answers). The rest: the bump and pruning.
    export_s: float = 0.0
    load_s: float = 0.0
    probe_s: float = 0.0


@dataclass
class PendingPublish:
    """A version every rank has written (:meth:`WeightPublisher.export`) whose announcement may still run."""

    result: PublishResult
    started: float  # time.monotonic() when the export began
    expected: list[float] | None  # the trainer's logprobs of the probe sequence (None: no probe)
    swaps: dict[str, Future] = field(default_factory=dict)  # in memory: each service's answer to the last bucket
    from_disk: list[str] | None = None  # the services that load the files (None: every serving one)


class WeightPublisher:
    """Publishes versions of the trainer's weights (rank 0 talks to the store and services; all ranks export)."""

    def __init__(self, store: Store, io: LoopThread, parallel: ParallelState, output_dir: Path, *, dtype: torch.dtype,
                 tokenizer: Any | None, keep: int = 2, retries: int = 3, adapter: bool = False,
                 probe: ProbeSettings | None = None, transport: Literal["distributed", "tensor", "disk"] = "disk",
                 bucket_mb: float = 256.0,
                 timeout_s: float = 120.0, address: str | None = None):
        self.store, self.io, self.parallel = store, io, parallel
        self.root = output_dir / "weights"
        self.dtype, self.tokenizer, self.keep, self.retries = dtype, tokenizer, keep, retries
        self.adapter, self.probe, self.transport = adapter, probe, transport
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.groups: WeightGroups | TensorSender | None = None
        if transport == "distributed" and parallel.is_main:
            self.groups = WeightGroups(io, backend="nccl" if parallel.device.type == "cuda" else "gloo",
                                       timeout_s=timeout_s, address=address)
        elif transport == "tensor" and parallel.is_main:
            self.groups = TensorSender(io, timeout_s=timeout_s)

    def publish(self, model: nn.Module, version: int) -> PublishResult:
        """Publish ``model`` as ``version`` and wait until it is served (every rank calls this; the result is
        complete on rank 0)."""
        pending = self.export(model, version)
        if self.parallel.is_main:
            self.io.run(self.announce(pending))
        return self.finish(pending)

    def export(self, model: nn.Module, version: int) -> PendingPublish:
        """Send or write ``model`` as ``version`` and compute the probe's expected logprobs (every rank); the
        services swap in what they received, load the files and hear of the version from :meth:`announce`. The
        model may change once this returns."""
        started = time.monotonic()
        result = PublishResult(version=version, path=None)
        pending = PendingPublish(result=result, started=started, expected=None)
        to_disk = True
        if self.transport != "disk":
            memory, pending.from_disk = self.io.run(self._plan()) if self.parallel.is_main else ([], [])
            if self.parallel.broadcast_from_main(bool(memory)):
                sent = self._send(model, memory, version)
                for url, error in sent.failures.items():
                    logger.warning("publishing weights version %d: the in-memory transfer to inference service %s "
                                   "failed (%s): it loads this version from disk", version, url, error)
                    pending.from_disk.append(url)
                pending.swaps, result.in_memory = sent.last, len(sent.last)
            to_disk = self.parallel.broadcast_from_main(bool(pending.from_disk))
        if to_disk:
            result.path = (self.root / str(version)).resolve()
            if self.parallel.is_main:
                self.root.mkdir(parents=True, exist_ok=True)
            if self.adapter:
                export_adapter(model, self.parallel, result.path)
            else:
                export_pretrained(model, self.parallel, result.path, dtype=self.dtype, tokenizer=self.tokenizer)
        result.export_s = time.monotonic() - started
        failpoint("publish.after_export")
        probe_started = time.monotonic()
        pending.expected = None if self.probe is None else trainer_logprobs(model, self.probe.token_ids,
                                                                            self.parallel.device)
        result.probe_s = time.monotonic() - probe_started
        result.seconds = time.monotonic() - started
        return pending

    async def _plan(self) -> tuple[list[str], list[str]]:
        """Rank 0: which serving services get this version in memory (their groups joined) and which from disk
        (those that cannot join one)."""
        assert self.groups is not None
        urls = [s.base_url for s in await self.store.services.serving()]
        for gone in set(self.groups.members) - set(urls):
            self.groups.drop(gone)
        reasons = await asyncio.gather(*(self.groups.join(url) for url in urls))
        return ([url for url, reason in zip(urls, reasons) if reason is None],
                [url for url, reason in zip(urls, reasons) if reason is not None])

    def _send(self, model: nn.Module, urls: list[str], version: int) -> SendResult:
        """Every rank: gather the buckets; rank 0 broadcasts them to the services ``urls``."""
        buckets = parameter_buckets(model, self.parallel, dtype=self.dtype, device=self._send_device(),
                                    limit_bytes=self.bucket_bytes)
        if not self.parallel.is_main:
            for _ in buckets:  # the gathers are collectives
                pass
            return SendResult()
        assert self.groups is not None
        return self.groups.send(buckets, urls, version)

    def _send_device(self) -> torch.device:
        return self.parallel.device if self.parallel.device.type == "cuda" else torch.device("cpu")

    async def announce(self, pending: PendingPublish) -> None:
        """Rank 0, on the io loop: every live service swaps in or loads the version, the probe checks them, the
        Run's ``policy_version`` moves to it (:class:`PublishError` if another writer moved it)."""
        result = pending.result
        disk = pending.from_disk
        if disk is None:
            disk = [s.base_url for s in await self.store.services.serving()]
        urls = [*pending.swaps, *disk]
        result.services = len(urls)
        started = time.monotonic()
        errors = await asyncio.gather(*(self._swapped(answer) for answer in pending.swaps.values()),
                                      *(self._load_on(url, result) for url in disk))
        result.load_s = time.monotonic() - started
        for url, error in zip(urls, errors):
            if error is not None:
                result.failures[url] = error
                logger.error("publishing weights version %d: inference service %s did not load them: %s",
                             result.version, url, error)
        if pending.expected is not None:
            started = time.monotonic()
            await self._probe([url for url in urls if url not in result.failures], result, pending.expected)
            result.probe_s += time.monotonic() - started
        failpoint("publish.before_bump")
        lora_name = policy_adapter_name(result.version) if self.adapter else None
        try:
            await self.store.runs.bump_policy_version(None if result.path is None else str(result.path),
                                                      expected=result.version - 1, lora_name=lora_name,
                                                      publish_id=uuid.uuid4().hex)
        except VersionConflict as error:
            raise PublishError(f"cannot publish weights version {result.version}: {error}") from error
        result.seconds = time.monotonic() - pending.started
        how = f"{result.in_memory} in memory" + (f", {len(disk)} from {result.path}" if result.path else "")
        logger.info("published weights version %d%s to %d of %d inference services (%s)", result.version,
                    f" as LoRA adapter {lora_name}" if lora_name else "", result.services - len(result.failures),
                    result.services, how)

    async def _swapped(self, answer: Future) -> str | None:
        """A service's answer to the last bucket (it swapped the version in); the error text if it refused."""
        try:
            await asyncio.wrap_future(answer)
        except Exception as error:  # noqa: BLE001 - reported by service
            return str(error)
        return None

    def finish(self, pending: PendingPublish) -> PublishResult:
        """After :meth:`announce` returned on rank 0 (every rank calls this): older versions are pruned and the ranks
        wait for each other."""
        if self.parallel.is_main and pending.result.path is not None:
            pruned = self._prune(pending.result.version)
            if self.adapter and pruned:
                self.io.submit(self._unload([policy_adapter_name(v) for v in pruned]))
        self.parallel.barrier()
        return pending.result

    def close(self) -> None:
        if self.groups is not None:
            self.groups.close()

    async def _load_on(self, base_url: str, result: PublishResult) -> str | None:
        """Have one service load the weights; the error text if it still fails after the client's retries."""
        from agentrl.inference.client import InferenceServiceError, SGLangClient

        async with SGLangClient(base_url, max_retries=self.retries) as client:
            try:
                if not self.adapter:
                    await client.update_weights_from_disk(str(result.path), weight_version=str(result.version))
                    return None
                name = policy_adapter_name(result.version)
                try:
                    await client.load_lora_adapter(name, str(result.path))
                except InferenceServiceError as error:
                    if "already loaded" not in str(error):
                        raise
                    # left by a publish of this version that crashed before the bump: no sampler names it yet
                    await client.unload_lora_adapter(name)
                    await client.load_lora_adapter(name, str(result.path))
            except InferenceServiceError as error:
                return str(error)
        return None

    async def _probe(self, urls: list[str], result: PublishResult, expected: list[float]) -> None:
        """Check the policy each service in ``urls`` serves now; record every verdict, report the failures."""
        assert self.probe is not None
        adapter = policy_adapter_name(result.version) if self.adapter else None
        verdicts = await asyncio.gather(*(check_service(
            url, self.probe.token_ids, expected, version=result.version, adapter=adapter,
            max_mean_abs_diff=self.probe.max_mean_abs_diff, retries=self.retries) for url in urls))
        for url, probe in zip(urls, verdicts):
            if probe is None:
                continue
            result.probes[url] = probe
            await self.store.services.record_probe(url, probe)
            if not probe.ok:
                logger.error("policy probe after publishing weights version %d: inference service %s does not "
                             "serve the trainer's policy (%s): samplers keep off it until it passes a later probe "
                             "or restarts", result.version, url, probe.error)

    async def _unload(self, names: list[str]) -> None:
        """Unload adapters of pruned versions from the live services (each answers once no request uses them)."""
        from agentrl.inference.client import InferenceServiceError, SGLangClient

        for service in await self.store.services.serving():
            async with SGLangClient(service.base_url, max_retries=self.retries) as client:
                for name in names:
                    try:
                        await client.unload_lora_adapter(name)
                    except InferenceServiceError as error:  # gone already (a restart), or the service is down
                        logger.debug("unloading adapter %s: %s", name, error)

    def _prune(self, newest: int) -> list[int]:
        """Delete the weight directories older than the last ``keep``; returns their versions."""
        versions = sorted(int(p.name) for p in self.root.iterdir() if p.name.isdigit() and int(p.name) <= newest)
        for version in versions[:-self.keep]:
            shutil.rmtree(self.root / str(version), ignore_errors=True)
        return versions[:-self.keep]
