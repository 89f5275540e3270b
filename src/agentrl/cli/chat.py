"""`agentrl chat`: talk to a checkpoint (an `agentrl engine` started for it) or a live SGLang/agentrl service,
optionally with MCP tools; the model's tool calls run and their results are shown. `quit`, `exit` or Ctrl-D
leave, `/reset` starts a new conversation; Ctrl-C interrupts a reply."""

from __future__ import annotations

import argparse
import sys

from agentrl.scoring.answers import ANSWER_SCHEMAS

QUIT = frozenset({"quit", "exit", "/quit", "/exit", ":q"})


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat", help="interactive terminal chat with a checkpoint or a live inference service",
        description="Chat with a model in the terminal, through the same prompt rendering, tool-call parsing "
                    "and MCP tools as training rollouts. Without --url an `agentrl engine` is started on "
                    "--model_name_or_path (stopped on exit). Type quit, exit or Ctrl-D to leave, /reset to start "
                    "over. Reads stdin line by line, so input can be piped.")
    p.add_argument("--model_name_or_path", default=None,
                   help="checkpoint to serve, or with --url the tokenizer/chat template of the served model "
                        "(default: the embedded SmolLM2 model)")
    p.add_argument("--url", default=None,
                   help="base URL of a live SGLang or agentrl engine service, e.g. http://127.0.0.1:30000 "
                        "(default: start an engine)")
    p.add_argument("--engine_args", default="",
                   help="extra `agentrl engine` flags when it is started here, e.g. \"--device cuda\"")
    g = p.add_argument_group("generation")
    g.add_argument("--temperature", type=float, default=0.7, help="0 for greedy (default: 0.7)")
    g.add_argument("--top_p", type=float, default=1.0)
    g.add_argument("--top_k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None, help="seed the engine's sampling")
    g.add_argument("--max_new_tokens", type=int, default=512, help="tokens per model call (default: 512)")
    g.add_argument("--max_turns", type=int, default=8,
                   help="model calls per user message, tool rounds included (default: 8)")
    g.add_argument("--system_prompt", default=None,
                   help="system prompt (default: the rollouts' default, which asks for --answer_schema answers); "
                        "tool instructions are appended when the chat template ignores tools")
    g.add_argument("--answer_schema", choices=(*ANSWER_SCHEMAS, "none"), default="boxed",
                   help="how the default system prompt asks for final answers (default: boxed)")
    g.add_argument("--request_timeout", type=float, default=600.0, help="seconds per model call")
    t = p.add_argument_group("tools")
    t.add_argument("--tools", default=None,
                   help="comma-separated built-in MCP servers to start over stdio: calculator, python")
    t.add_argument("--mcp_config", default=None, help="JSON/YAML file listing more MCP servers")
    t.add_argument("--mcp_server_name", default=None, help="only these servers of --mcp_config (comma-separated)")
    t.add_argument("--tool_call_parser", default="qwen", help="qwen | hermes | openai | minicpm (default: qwen)")
    t.add_argument("--tool_timeout", type=float, default=60.0, help="seconds per tool call")
    p.set_defaults(func=run)


def _tool_manager(args: argparse.Namespace):
    from agentrl.tools import ToolManager
    from agentrl.tools.config import MCPConfig, builtin_servers_config, load_mcp_config, parse_server_filter

    names = [n.strip() for n in (args.tools or "").split(",") if n.strip()]
    servers = list(builtin_servers_config(names).servers) if names else []
    if args.mcp_config:
        servers += load_mcp_config(args.mcp_config).select(parse_server_filter(args.mcp_server_name)).servers
    if not servers:
        return None
    return ToolManager(MCPConfig(servers=servers))


def _load_tokenizer(path: str | None, url: str | None, err) -> object:
    from pathlib import Path

    from agentrl.inference.policy_tokenizer import policy_tokenizer

    if path is None and url is not None:
        import asyncio

        from agentrl.inference.client import SGLangClient

        async def served_path() -> str | None:
            async with SGLangClient(url, timeout_s=10, max_retries=1) as client:
                info = await client.get_model_info()
                return info.tokenizer_path or info.model_path

        try:
            served = asyncio.run(served_path())
        except Exception as error:  # noqa: BLE001 - only a hint; the embedded tokenizer is the fallback
            err(f"could not ask {url} for its model ({error})")
            served = None
        if served and Path(served).is_dir():
            path = served
        else:
            err(f"using the embedded model's tokenizer for {url}; pass --model_name_or_path if the service runs "
                "another model")
    return policy_tokenizer(path)


class _Printer:
    """Prints chat events as plain lines (colours only on a terminal)."""

    STYLES = {"reasoning": "dim", "assistant": "bold", "tool_call": "cyan", "tool_result": "green",
              "notice": "yellow"}
    LABELS = {"reasoning": "thinking", "assistant": "assistant", "tool_call": "tool call",
              "tool_result": "tool result", "notice": "note"}

    def __init__(self) -> None:
        from rich.console import Console

        self.console = Console(highlight=False, soft_wrap=True)

    def event(self, event) -> None:
        kind = str(event.kind)
        label = self.LABELS[kind]
        style = self.STYLES[kind]
        if not event.ok and kind in ("tool_call", "tool_result"):
            label, style = f"{label} (error)", "red"
        self.console.print(f"[{label}] {event.text}", style=style, markup=False)
        sys.stdout.flush()

    def info(self, text: str) -> None:
        self.console.print(text, style="dim", markup=False)
        sys.stdout.flush()


def _read_line(interactive: bool) -> str | None:
    """The next input line, None at end of input (Ctrl-D)."""
    if interactive:
        try:
            return input("you> ")
        except EOFError:
            print()
            return None
    line = sys.stdin.readline()
    return None if line == "" else line.rstrip("\n")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import shlex

    from pydantic import ValidationError

    from agentrl.inference.protocol import SamplingParams
    from agentrl.rollout.chat_session import ChatSettings
    from agentrl.rollout.tool_parsers import get_parser
    from agentrl.tools.errors import ToolConfigError, ToolError

    def err(text: str) -> None:
        print(f"agentrl chat: {text}", file=sys.stderr, flush=True)

    if args.max_turns < 1 or args.max_new_tokens < 1:
        err("error: --max_turns and --max_new_tokens must be at least 1")
        return 2
    settings = ChatSettings(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, max_turns=args.max_turns, system_prompt=args.system_prompt, answer_schema=args.answer_schema,
        tool_timeout=args.tool_timeout)
    try:
        SamplingParams.model_validate(settings.sampling_params(0))
        parser = get_parser(args.tool_call_parser)
        tools = _tool_manager(args)
    except ValidationError as error:
        err(f"error: invalid sampling options: {'; '.join(e['msg'] for e in error.errors())}")
        return 2
    except (KeyError, ToolConfigError) as error:
        err(f"error: {error.args[0] if isinstance(error, KeyError) else error}")
        return 2

    engine = None
    url = args.url
    if url is None:
        from agentrl.inference.process import EngineProcess, EngineStartError

        err(f"starting agentrl engine on {args.model_name_or_path or 'the embedded model'} ...")
        try:
            engine = EngineProcess(args.model_name_or_path, "--no_register", *shlex.split(args.engine_args))
        except EngineStartError as error:
            err(f"error: {error}")
            return 1
        url = engine.url
    try:
        tokenizer = _load_tokenizer(args.model_name_or_path, args.url, err)
        with asyncio.Runner() as runner:
            return _loop(runner, url, tokenizer, parser, tools, settings, args.request_timeout, err)
    except ToolError as error:
        err(f"error: {error}")
        return 1
    finally:
        if engine is not None:
            engine.stop()


def _loop(runner, url: str, tokenizer, parser, tools, settings, request_timeout: float, err) -> int:
    from agentrl.inference.client import InferenceServiceError, SGLangClient
    from agentrl.rollout.chat_session import ChatSession

    client = SGLangClient(url, timeout_s=request_timeout)
    printer = _Printer()
    interactive = sys.stdin.isatty()
    if tools is not None:
        runner.run(tools.__aenter__())
    try:
        session = ChatSession(tokenizer, client.generate, parser, tools=tools, settings=settings)
        names = ", ".join(spec["function"]["name"] for spec in session.tool_specs) or "none"
        printer.info(f"chatting with {url} (tools: {names}); quit, exit or Ctrl-D to leave, /reset to start over")
        while True:
            try:
                line = _read_line(interactive)
            except KeyboardInterrupt:
                print()
                return 0
            if line is None or line.strip().lower() in QUIT:
                return 0
            text = line.strip()
            if not text:
                continue
            if not interactive:  # a transcript of piped input shows what was asked
                printer.info(f"you> {text}")
            if text == "/reset":
                session.reset()
                printer.info("(new conversation)")
                continue
            try:
                runner.run(session.send(text, printer.event))
            except KeyboardInterrupt:
                printer.info("(interrupted; the message was dropped)")
            except InferenceServiceError as error:
                err(f"error: {error} (the message was dropped)")
    finally:
        runner.run(client.close())
        if tools is not None:
            runner.run(tools.__aexit__(None, None, None))
