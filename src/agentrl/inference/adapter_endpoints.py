"""SGLang's LoRA adapter endpoints of one engine (with ``enable_lora``, SGLang's ``--enable-lora``): PEFT adapters
served next to the base weights; a ``/generate`` request names one in ``lora_path``. Loading pauses generation for
one step; unloading waits until no admitted request uses the adapter (new requests naming it are refused at once).
``weight_version`` stays as it is, as in SGLang: the adapter's name tells which weights made the tokens."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from agentrl.failpoints import failpoint
from agentrl.inference.batching import ContinuousBatcher
from agentrl.inference.lora_adapters import AdapterError, read_adapter
from agentrl.inference.protocol import BadRequest, LoadLoRAAdapterRequest, LoRAUpdateResponse, UnloadLoRAAdapterRequest

logger = logging.getLogger(__name__)


class AdapterEndpoints:
    """The adapters ``batcher`` serves (``enabled``: LoRA on), and the admitted requests using each;
    ``exclusive`` is the engine's lock for changes between two decoding steps."""

    def __init__(self, batcher: ContinuousBatcher, enabled: bool, exclusive: asyncio.Lock):
        self.batcher, self.model, self.enabled, self.exclusive = batcher, batcher.model, enabled, exclusive
        self._users: dict[str, int] = {}  # loaded adapter -> admitted requests using it
        self._idle: dict[str, asyncio.Event] = {}  # adapters being unloaded -> set when unused

    def use(self, name: str | None) -> None:
        """Count an admitted request on adapter ``name``; SGLang's errors for a disabled or unknown adapter."""
        if name is None:
            return
        if not self.enabled:
            raise BadRequest(f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the "
                             "engine with --enable_lora and load adapters with the /load_lora_adapter endpoint.")
        if name not in self._users or name in self._idle:
            raise BadRequest(f"The following requested LoRA adapters are not loaded: {name}\n"
                             f"Loaded adapters: {sorted(self.loaded_adapters())}.")
        self._users[name] += 1

    def release(self, name: str | None) -> None:
        if name is None:
            return
        self._users[name] -= 1
        if not self._users[name] and name in self._idle:
            self._idle[name].set()

    def loaded_adapters(self) -> dict[str, str]:
        """Adapters that requests may name: name -> the path it was loaded from."""
        return {name: adapter.path for name, adapter in self.batcher.adapters.adapters.items()
                if name not in self._idle}

    def _lora_result(self, error: str | None = None) -> LoRAUpdateResponse:
        return LoRAUpdateResponse(success=error is None, error_message=error, loaded_adapters=self.loaded_adapters())

    async def load_lora_adapter(self, request: LoadLoRAAdapterRequest) -> LoRAUpdateResponse:
        """Serve the PEFT adapter at ``lora_path`` under ``lora_name`` (running requests are not disturbed)."""
        if not self.enabled:
            return self._lora_result("LoRA is not enabled. Please launch the engine with --enable_lora.")
        name = request.lora_name
        if name in self._users:
            return self._lora_result(f"Failed to load LoRA adapter {name} because it is already loaded")
        started = time.perf_counter()
        try:
            adapter = await asyncio.to_thread(read_adapter, name, request.lora_path, self.model)
            if failpoint("engine.load_lora_adapter.apply"):
                adapter = dataclasses.replace(adapter, layers={})
        except AdapterError as error:
            return self._lora_result(f"Failed to load LoRA adapter {name}: {error}")
        except Exception as error:  # noqa: BLE001 - reported to the caller, who asked for this path
            return self._lora_result(f"Failed to load LoRA adapter {name} from {request.lora_path}: {error}")
        async with self.exclusive:
            if name in self._users:  # loaded by a concurrent request meanwhile
                return self._lora_result(f"Failed to load LoRA adapter {name} because it is already loaded")
            await asyncio.to_thread(self.batcher.add_adapter, adapter)
            self._users[name] = 0
        logger.info("loaded LoRA adapter %s from %s (%d layers) in %.2fs", name, request.lora_path,
                    len(adapter.layers), time.perf_counter() - started)
        return self._lora_result()

    async def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> LoRAUpdateResponse:
        """Stop serving adapter ``lora_name`` once the requests using it have finished; new ones are refused."""
        if not self.enabled:
            return self._lora_result("LoRA is not enabled. Please launch the engine with --enable_lora.")
        name = request.lora_name
        if name not in self._users or name in self._idle:
            return self._lora_result(f"LoRA with name {name} does not exist. Loaded LoRAs: "
                                     f"{sorted(self.loaded_adapters())}")
        idle = self._idle[name] = asyncio.Event()
        if not self._users[name]:
            idle.set()
        try:
            await idle.wait()
        except asyncio.CancelledError:  # the caller gave up: the adapter stays loaded and usable
            del self._idle[name]
            raise
        async with self.exclusive:
            await asyncio.to_thread(self.batcher.remove_adapter, name)
            del self._users[name], self._idle[name]
        logger.info("unloaded LoRA adapter %s", name)
        return self._lora_result()
