"""Assemble a sampler process from its configuration: store, tokenizer, tools, environments, scorers, inference
pool.

The sampler and its inference pool share one owner id (``--sampler_id`` or ``host:pid:random``): slot leases and
in-flight request counts of a process are its; the owner TTL of its request counts is ``--lease_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import httpx
from pymongo.errors import PyMongoError

from agentrl.envs.pool import EnvPool, parse_env_servers
from agentrl.inference.policy_tokenizer import policy_tokenizer
from agentrl.log import redact
from agentrl.rollout.agent import AgentResources
from agentrl.rollout.config import SamplerConfig
from agentrl.rollout.inference_pool import InferencePool
from agentrl.rollout.sampler import Sampler, SamplerStats
from agentrl.rollout.tool_parsers import get_parser
from agentrl.scoring import AgentConfig, MCPScorerFactory, load_agent_config
from agentrl.store import Store, database_name, resolve_connection_string
from agentrl.store.outage import outage_tolerance_s
from agentrl.tools import ToolManager
from agentrl.vision.processor import VisionProcessor

logger = logging.getLogger(__name__)

URL_HEALTH_INTERVAL_S = 10.0


async def _watch_static_services(store: Store, pool: InferencePool, urls: list[str],
                                 interval_s: float = URL_HEALTH_INTERVAL_S) -> None:
    """Keep the SGLang URLs given on the command line registered from their health checks: a healthy service is
    heartbeated (registered first if it is not yet), an unhealthy one marked DOWN. Errors (database, HTTP) are
    logged and retried at the next round; the watcher only stops when cancelled."""
    while True:
        for url in urls:
            try:
                if await pool.client(url).health():
                    if not await store.services.heartbeat(url):
                        await store.services.register(url, kind="sglang")
                        logger.info("registered inference service %s", redact(url))
                else:
                    logger.warning("inference service %s is not healthy: marked DOWN", redact(url))
                    await store.services.mark_down(url)
            except (PyMongoError, httpx.HTTPError) as error:
                logger.warning("health watch of inference service %s failed (retrying in %.0fs): %s: %s",
                               redact(url), interval_s, type(error).__name__, redact(str(error)))
            except Exception:  # an unexpected error must not end the watch either
                logger.exception("health watch of inference service %s failed (retrying in %.0fs)",
                                 redact(url), interval_s)
        await asyncio.sleep(interval_s)


async def agree_run_values(store: Store, uri: str, config: SamplerConfig) -> SamplerConfig:
    """A train-split sampler's configuration with the values its run records (``RunValues``: batch size,
    staleness bound, temperature) where it was given none, recording those it was given unless recorded before; a
    given value that differs from the run's raises ``RunValuesConflict``. Samplers of other splits do not take
    part. (A value another process records later is taken up while sampling: ``Sampler``.)"""
    if config.split != "train":
        return config
    run = await store.runs.agree(database_name(uri), config.run_values(), config.run_value_sources())
    return config.with_run_values(run.values)


@contextlib.asynccontextmanager
async def sampler_resources(config: SamplerConfig) -> AsyncIterator[AgentResources]:
    """Open everything a sampler needs (and close it afterwards)."""
    tools_cfg, limits = config.tools, config.concurrency
    for module in tools_cfg.scorer_module:
        MCPScorerFactory.load_module(module)
    uri = resolve_connection_string(config.db_connection_string)
    tokenizer = policy_tokenizer(config.model_name_or_path)
    agent_config = load_agent_config(tools_cfg.agent_config_path) if tools_cfg.agent_config_path else AgentConfig()
    async with contextlib.AsyncExitStack() as stack:
        store = await stack.enter_async_context(Store(uri, lease_s=limits.lease_s,
                                                      connect_timeout_s=outage_tolerance_s()))
        config = await agree_run_values(store, uri, config)
        pool = InferencePool(store, owner=config.sampler_id, owner_ttl_s=limits.lease_s,
                             target_concurrency=limits.target_concurrency, timeout_s=limits.request_timeout)
        stack.push_async_callback(pool.close)
        tools = None
        if tools_cfg.mcp_config or tools_cfg.mcp_manager_url:
            tools = await stack.enter_async_context(ToolManager.from_options(
                mcp_config=tools_cfg.mcp_config, mcp_manager_url=tools_cfg.mcp_manager_url,
                mcp_server_name=tools_cfg.mcp_server_name, mcp_auth_token=tools_cfg.mcp_auth_token))
        if config.inference_urls:
            watcher = asyncio.create_task(_watch_static_services(store, pool, config.inference_urls))
            stack.callback(watcher.cancel)
        envs = EnvPool(parse_env_servers(tools_cfg.env_server), timeout=limits.request_timeout)
        stack.push_async_callback(envs.aclose)
        yield AgentResources(store=store, tokenizer=tokenizer, inference=pool,
                             parser=get_parser(config.rollout.tool_call_parser), config=config, tools=tools,
                             agent_config=agent_config, envs=envs,
                             vision=VisionProcessor.of(config.model_name_or_path) if config.model_name_or_path
                             else None)


async def run_sampler(config: SamplerConfig) -> SamplerStats:
    """Run one sampler until it is stopped (SIGTERM/SIGINT) or, with ``exit_when_done``, its split is done."""
    if config.split == "train" and config.allow_biased_sampling:
        logger.warning("--allow_biased_sampling: the engine's logprobs may come from another distribution than the "
                       "one it sampled from (top-p/top-k/min-p truncation, penalties), which biases the trainer's "
                       "importance ratio")
    async with sampler_resources(config) as resources:
        sampler = Sampler(resources, owner=resources.inference.owner)  # one identity for slots and load
        sampler.install_signal_handlers()
        return await sampler.run()
