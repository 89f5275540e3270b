"""``agentrl engine`` stops promptly on SIGTERM: long generations in flight are aborted (their clients get finish
reason ``abort``, nobody hangs) and the process exits with status 0 within seconds. A real engine process."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from pathlib import Path

from agentrl.inference import SGLangClient
from agentrl.inference.process import EngineProcess

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 2]
LONG = {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 1.0}  # the tiny model's whole context
EXIT_LIMIT_S = 10.0


async def test_sigterm_aborts_running_generations_and_exits_within_seconds(
        launch_engine: Callable[..., EngineProcess], tiny_model_dir: Path) -> None:
    engine = launch_engine(tiny_model_dir)
    try:
        async with SGLangClient(engine.url, max_retries=0) as client:
            running = [asyncio.create_task(client.generate(PROMPT, {**LONG, "sampling_seed": i})) for i in range(4)]
            await asyncio.sleep(2.0)  # all four are being decoded: minutes of work for one CPU thread
            assert not any(task.done() for task in running)
            started = time.monotonic()
            engine.process.send_signal(signal.SIGTERM)
            status = await asyncio.to_thread(engine.process.wait, 30)
            elapsed = time.monotonic() - started
            results = await asyncio.wait_for(asyncio.gather(*running), 5)
    finally:
        engine.stop()
    assert status == 0, engine.output
    # measured 2.2 s alone on 2 cores, 5.4 s once beside the suite's 4 workers; the generations cut short would
    # have taken minutes
    assert elapsed < EXIT_LIMIT_S, f"the engine took {elapsed:.1f}s to exit"
    for result in results:
        assert result.finish_reason == "abort" and result.completion_tokens < LONG["max_new_tokens"]
        assert result.meta_info["finish_reason"]["message"] == "the engine is shutting down"
