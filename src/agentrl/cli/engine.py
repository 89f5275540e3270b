"""`agentrl engine`: serve a Hugging Face causal LM over SGLang's native HTTP API (plus OpenAI chat). Its flags are
generated from :class:`agentrl.inference.engine_config.EngineCommandConfig`."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from agentrl.config_flags import add_model_arguments
    from agentrl.inference.engine_config import EngineCommandConfig

    parser = sub.add_parser(
        "engine", help="serve a model over SGLang's HTTP API (token ids in, token ids and logprobs out)",
        description="Serve a causal LM with transformers continuous batching, speaking SGLang's native API "
                    "(/generate, /update_weights_from_disk, /health, /health_generate, /get_model_info, "
                    "/flush_cache, /release_memory_occupation, /resume_memory_occupation, /load_lora_adapter, "
                    "/unload_lora_adapter) and "
                    "/v1/chat/completions.")
    add_model_arguments(parser, EngineCommandConfig)
    parser.set_defaults(func=run, _parser=parser)


def run(args: argparse.Namespace) -> int:
    import os
    import sys

    import torch
    from pydantic import SecretStr

    from agentrl.config_flags import model_from_namespace
    from agentrl.inference.client import API_KEY_ENV
    from agentrl.inference.embedded_model import default_model_path
    from agentrl.inference.engine import default_num_threads
    from agentrl.inference.engine_config import EngineCommandConfig, EngineConfig
    from agentrl.inference.server import serve
    from agentrl.listen import is_loopback

    config = model_from_namespace(EngineCommandConfig, args, args._parser)
    given_key = config.server.api_key.get_secret_value() if config.server.api_key else None
    api_key = given_key or os.environ.get(API_KEY_ENV) or None
    if api_key is None and not is_loopback(config.server.host):
        print(f"agentrl engine: error: --host {config.server.host} is reachable from other machines, and anyone who "
              f"reaches the engine could replace its weights: set ${API_KEY_ENV} (or --api_key) here and where the "
              "samplers and the trainer run, or keep the default 127.0.0.1", file=sys.stderr)
        return 2
    torch.set_num_threads(config.num_threads or default_num_threads())
    db = None if config.no_register else (config.server.db_connection_string or os.environ.get("AGENTRL_DB"))
    engine_config = EngineConfig(model_name_or_path=config.model_name_or_path or str(default_model_path()),
                                 **config.serving.model_dump())
    server_config = config.server.model_copy(update={"db_connection_string": db,
                                                     "api_key": SecretStr(api_key) if api_key else None})
    return serve(engine_config, server_config)
