"""`agentrl engine`: serve a Hugging Face causal LM over SGLang's native HTTP API (plus OpenAI chat)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "engine", help="serve a model over SGLang's HTTP API (token ids in, token ids and logprobs out)",
        description="Serve a causal LM with transformers continuous batching, speaking SGLang's native API "
                    "(/generate, /update_weights_from_disk, /health, /health_generate, /get_model_info, "
                    "/flush_cache, /release_memory_occupation, /resume_memory_occupation, /load_lora_adapter, "
                    "/unload_lora_adapter) and "
                    "/v1/chat/completions.")
    parser.add_argument("--model_name_or_path", default=None,
                        help="Hugging Face model directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--served_model_name", default=None, help="model name reported to clients")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: 127.0.0.1; any other needs an API key)")
    parser.add_argument("--port", type=int, default=30000, help="port to listen on, 0 for a free one (default: 30000)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights dtype (auto: bfloat16 on CUDA GPUs with bf16 support; on a CPU with bf16 matrix "
                             "instructions float32 weights whose layers but the LM head multiply in bf16; float32 "
                             "elsewhere)")
    parser.add_argument("--weight_version", default="0", help="version reported for the initial weights")
    parser.add_argument("--preferred_sampling_params", default=None, metavar="JSON",
                        help="the server's values of sampling parameters a /generate request omits, as SGLang's "
                             "--preferred-sampling-params, e.g. '{\"temperature\": 0.6, \"top_p\": 0.95}' "
                             "(default: SGLang's defaults: temperature 1, top_p 1, top_k -1, min_p 0, no penalties). "
                             "presence_penalty/frequency_penalty subtract from the logits of generated tokens; the "
                             "returned logprobs then include them, which a trainer cannot reproduce")
    parser.add_argument("--max_total_tokens", type=int, default=32768,
                        help="KV cache capacity in tokens, all requests together (default: 32768)")
    parser.add_argument("--page_size", type=int, default=32,
                        help="tokens per KV-cache page; prompts share cached pages of a common prefix (the system "
                             "prompt, earlier turns), so smaller pages share more (default: 32)")
    parser.add_argument("--max_batch_tokens", type=int, default=2048,
                        help="tokens per forward pass, i.e. the prefill chunk (default: 2048)")
    parser.add_argument("--max_running_requests", type=int, default=64,
                        help="requests decoded together at most (default: 64)")
    parser.add_argument("--disable_cuda_graph", action="store_true",
                        help="on CUDA, run decode steps eagerly instead of replaying them as CUDA graphs captured "
                             "once per batch size (SGLang's --disable-cuda-graph)")
    parser.add_argument("--cuda_graph_max_bs", type=int, default=64,
                        help="the largest decode batch run as a CUDA graph; larger ones run eagerly (SGLang's "
                             "--cuda-graph-max-bs; default: 64)")
    parser.add_argument("--enable_lora", action="store_true",
                        help="serve LoRA adapters loaded at run time with /load_lora_adapter; a /generate request "
                             "names one in lora_path (SGLang's --enable-lora). Turns prefix sharing off")
    parser.add_argument("--weight_update_timeout_s", type=float, default=120.0,
                        help="how long joining a weight-update group (/init_weights_update_group), and each of its "
                             "transfers, may take before it fails (default: 120)")
    parser.add_argument("--weight_update_mode", choices=("in_place", "drain"), default="in_place",
                        help="in_place: new weights are swapped in between two decoding steps, running requests go "
                             "on with them and each token keeps the version that sampled it (a response spanning "
                             "two versions lists them in meta_info.weight_version_spans); drain: running requests "
                             "finish on the old weights while new ones wait, as SGLang without /pause_generation "
                             "(default: in_place)")
    parser.add_argument("--api_key", default=None,
                        help="every request but /health and /health_generate must carry 'Authorization: Bearer "
                             "KEY' (SGLang's --api-key; default: $AGENTRL_INFERENCE_API_KEY, which the samplers, "
                             "trainer and evaluations send; prefer the variable: a command line is visible to other "
                             "users)")
    parser.add_argument("--num_threads", type=int, default=None,
                        help="torch CPU threads (default: $OMP_NUM_THREADS if set, else one less than the CPUs this "
                             "machine gives the engine, at least 1: a decode step's small operations wait for "
                             "every thread of the team, and the server and its neighbours need a core)")
    parser.add_argument("--db_connection_string", default=None, metavar="URI",
                        help="register the engine in this run database's InferenceService collection, heartbeat, "
                             "mark it DOWN on exit (default: $AGENTRL_DB if set, else no registration)")
    parser.add_argument("--no_register", action="store_true",
                        help="do not register in the database even if $AGENTRL_DB is set")
    parser.add_argument("--advertise_url", default=None,
                        help="URL to register in the database (default: http://HOST:PORT)")
    parser.add_argument("--heartbeat_interval_s", type=float, default=5.0,
                        help="seconds between heartbeats to the database (default: 5)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json
    import os
    import sys

    import torch
    from pydantic import ValidationError

    from agentrl.inference.client import API_KEY_ENV
    from agentrl.inference.embedded_model import default_model_path
    from agentrl.inference.engine import EngineConfig, default_num_threads
    from agentrl.inference.server import EngineServerConfig, serve
    from agentrl.listen import is_loopback

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if api_key is None and not is_loopback(args.host):
        print(f"agentrl engine: error: --host {args.host} is reachable from other machines, and anyone who reaches "
              f"the engine could replace its weights: set ${API_KEY_ENV} (or --api_key) here and where the "
              "samplers and the trainer run, or keep the default 127.0.0.1", file=sys.stderr)
        return 2

    torch.set_num_threads(args.num_threads or default_num_threads())
    db = None if args.no_register else (args.db_connection_string or os.environ.get("AGENTRL_DB"))
    try:
        preferred = json.loads(args.preferred_sampling_params) if args.preferred_sampling_params else None
    except json.JSONDecodeError as error:
        print(f"agentrl engine: error: --preferred_sampling_params is not valid JSON: {error}", file=sys.stderr)
        return 2
    try:
        engine_config = EngineConfig(
            model_name_or_path=args.model_name_or_path or str(default_model_path()),
            served_model_name=args.served_model_name, device=args.device, dtype=args.dtype,
            weight_version=args.weight_version, max_total_tokens=args.max_total_tokens,
            max_batch_tokens=args.max_batch_tokens, max_running_requests=args.max_running_requests,
            page_size=args.page_size, preferred_sampling_params=preferred, enable_lora=args.enable_lora,
            weight_update_timeout_s=args.weight_update_timeout_s, weight_update_mode=args.weight_update_mode,
            disable_cuda_graph=args.disable_cuda_graph, cuda_graph_max_bs=args.cuda_graph_max_bs)
    except ValidationError as error:
        print(f"agentrl engine: error: {error}", file=sys.stderr)
        return 2
    server_config = EngineServerConfig(host=args.host, port=args.port, db_connection_string=db, api_key=api_key,
                                 advertise_url=args.advertise_url, heartbeat_interval_s=args.heartbeat_interval_s)
    return serve(engine_config, server_config)
