"""`agentrl sft demos TASKS`: tool-use demonstrations made with the real tool servers; `agentrl sft upload FILE`:
tokenise SFT conversations with the model's chat template and queue them as training samples (loss on assistant
tokens only) for ``agentrl train --loss_calculater CrossEntropy --enable_sampling false``."""

from __future__ import annotations

import argparse
import sys

from agentrl.cli.options import add_db_option
from agentrl.scoring.answers import ANSWER_SCHEMAS


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("sft", help="supervised fine-tuning data")
    actions = parser.add_subparsers(dest="sft_action", metavar="ACTION", required=True)
    upload = actions.add_parser(
        "upload", help="upload SFT conversations (OpenAI 'messages' or AgentGym 'conversations' JSONL)",
        description="Render every conversation with the model's chat template and queue it as a training sample "
                    "whose loss mask covers the assistant messages only (their content and end-of-turn token). "
                    "Every line is validated first: if any is invalid, each is reported as FILE:LINE and nothing "
                    "is inserted (unless --skip_invalid). Re-uploading a file does not duplicate samples. Then "
                    "train with: agentrl train --loss_calculater CrossEntropy --enable_sampling false")
    upload.add_argument("file", help="conversations as JSONL (one object per line) or JSON (a list of objects)")
    add_db_option(upload)
    upload.add_argument("--model_name_or_path", default=None,
                        help="tokenizer and chat template of the model to train (default: the embedded SmolLM2 "
                             "model); must be the model given to the trainer")
    upload.add_argument("--split", default="train", help="split of the sample queue (default: train)")
    upload.add_argument("--max_length", type=int, default=None,
                        help="longest conversation in tokens; a longer one is an invalid line (reported, nothing "
                             "inserted) unless --truncate (default: no limit)")
    upload.add_argument("--truncate", action="store_true",
                        help="keep the first --max_length tokens of a longer conversation instead of rejecting it")
    upload.add_argument("--skip_invalid", action="store_true", help="insert the valid lines, report the others")
    upload.add_argument("--dry_run", action="store_true", help="validate and report, insert nothing")
    upload.set_defaults(func=run_upload)

    demos = actions.add_parser(
        "demos", help="write tool-use demonstrations of tasks, calling the real tool servers",
        description="For every task, call the tools that solve it (its 'demo_calls', or `calculate` with its "
                    "'expression') on the real MCP servers and write the conversation a perfect agent would have: "
                    "the agent loop's system and user prompt, one <tool_call> turn per call, the tool's real "
                    "result, then the task's answer in its answer schema. The output is SFT data in the OpenAI "
                    "'messages' form; `agentrl sft upload` renders it token for token as a rollout. Every task is "
                    "checked first: if any cannot be demonstrated, each is reported as FILE:LINE and nothing is "
                    "written. A task with a worked solution ('demo_response', or a GSM8K answer ending '#### N' "
                    "under the gsm8k answer schema) is demonstrated by that solution, without tools.")
    demos.add_argument("tasks", help="task file, JSON or JSONL (as for `agentrl tasks upload`)")
    demos.add_argument("--out", required=True, help="where to write the demonstrations (JSONL)")
    demos.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N tasks")
    demos.add_argument("--answer_schema", choices=ANSWER_SCHEMAS, default="answer",
                       help="answer marker of tasks that name none (default: answer)")
    demos.add_argument("--query_prompt", default="{query}", help="user prompt template with {query}, as for "
                                                                 "`agentrl sample` (default: {query})")
    demos.add_argument("--tools", default="calculator",
                       help="comma-separated built-in MCP servers to start over stdio (default: calculator; empty "
                            "for none)")
    demos.add_argument("--mcp_config", default=None, help="MCP servers file (as for `agentrl sample`), in "
                                                          "addition to --tools")
    demos.add_argument("--mcp_server_name", default=None, help="only these servers of --mcp_config")
    demos.set_defaults(func=run_demos)


def run_upload(args: argparse.Namespace) -> int:
    import asyncio

    from agentrl.log import redact
    from agentrl.training.sft_data import SFTFileError, SFTOptions, parse_sft_file, upload_sft

    if args.max_length is not None and args.max_length < 2:
        print("error: --max_length must be at least 2", file=sys.stderr)
        return 2
    if args.truncate and args.max_length is None:
        print("error: --truncate needs --max_length", file=sys.stderr)
        return 2
    try:
        from agentrl.inference.policy_tokenizer import policy_tokenizer
        from agentrl.vision.processor import VisionProcessor

        tokenizer = policy_tokenizer(args.model_name_or_path)
        vision = VisionProcessor.of(args.model_name_or_path) if args.model_name_or_path else None
    except (OSError, ValueError) as error:
        print(f"error: cannot load the tokenizer of {args.model_name_or_path}: {error}", file=sys.stderr)
        return 2
    options = SFTOptions(split=args.split, max_length=args.max_length,
                         overlong="truncate" if args.truncate else "reject")
    try:
        parsed = parse_sft_file(args.file, tokenizer, options, vision)
    except SFTFileError as error:  # the file as a whole (missing, not UTF-8, tokenizer without a template)
        for problem in error.problems:
            print(problem, file=sys.stderr)
        print("error: nothing was inserted", file=sys.stderr)
        return 2
    if parsed.problems and (not args.skip_invalid or not parsed.samples):
        return _report_invalid(parsed.problems)
    for problem in parsed.problems:
        print(problem, file=sys.stderr)
    summary = (f"{len(parsed.samples)} conversations, {parsed.tokens} tokens ({parsed.trained_tokens} trained), "
               f"longest {parsed.longest}")
    notes = []
    if parsed.duplicates:
        notes.append(f"{parsed.duplicates} duplicate lines counted once")
    if parsed.truncated:
        notes.append(f"{parsed.truncated} truncated to {args.max_length} tokens")
    if parsed.problems:
        notes.append(f"{len(parsed.problems)} invalid skipped")
    suffix = f"; {', '.join(notes)}" if notes else ""
    if args.dry_run:
        print(f"dry run: {summary}{suffix}; nothing inserted")
        return 0

    from agentrl.store import Store, resolve_connection_string

    uri = resolve_connection_string(args.db_connection_string)

    async def upload():
        async with Store(uri) as store:
            return await upload_sft(store, parsed, skip_invalid=args.skip_invalid)

    result = asyncio.run(upload())
    print(f"inserted {result.inserted} SFT samples into {redact(uri)} (split {args.split}); "
          f"{result.already_present} already present; {summary}{suffix}")
    return 0


def _report_invalid(problems: list[str], what: str = "line") -> int:
    """Print every problem and what was (not) done; exit status 2. ``what``: ``line`` (upload) or ``task`` (demos)."""
    for problem in problems:
        print(problem, file=sys.stderr)
    count, plural = len(problems), "" if len(problems) == 1 else "s"
    if what == "task":
        print(f"error: {count} task{plural} cannot be demonstrated; nothing was written", file=sys.stderr)
    else:
        print(f"error: {count} invalid line{plural}; nothing was inserted (use --skip_invalid to insert the valid "
              "ones)", file=sys.stderr)
    return 2


def run_demos(args: argparse.Namespace) -> int:
    import asyncio
    import contextlib
    import json
    from pathlib import Path

    from agentrl.rollout.demonstrations import DemonstrationError, check, demonstrate
    from agentrl.store.task_files import TaskFileError, UploadDefaults, parse_file
    from agentrl.tools import ToolManager
    from agentrl.tools.config import MCPConfig, builtin_servers_config, load_mcp_config, parse_server_filter
    from agentrl.tools.errors import ToolConfigError

    if args.limit is not None and args.limit < 1:
        print("error: --limit must be at least 1", file=sys.stderr)
        return 2
    try:
        parsed = parse_file(args.tasks, UploadDefaults(num_generations=1, scorer="math",
                                                       answer_schema=args.answer_schema))
    except TaskFileError as error:
        return _report_invalid(error.problems, what="task")
    if parsed.problems:
        return _report_invalid(parsed.problems, what="task")
    entries = parsed.tasks[: args.limit] if args.limit else parsed.tasks
    problems = []
    needs_tools = False
    for line, task in entries:  # everything that can be checked without the tools, before any is started
        try:
            needs_tools = bool(check(task)) or needs_tools
        except DemonstrationError as error:
            problems.append(f"{args.tasks}:{line}: {error}")
    if problems:
        return _report_invalid(problems, what="task")
    try:
        names = [n.strip() for n in (args.tools or "").split(",") if n.strip()]
        servers = list(builtin_servers_config(names).servers)
        if args.mcp_config:
            servers += load_mcp_config(args.mcp_config).select(parse_server_filter(args.mcp_server_name)).servers
    except ToolConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if needs_tools and not servers:
        print("error: no tool servers: give --tools or --mcp_config", file=sys.stderr)
        return 2

    async def build() -> tuple[list[dict], list[str]]:
        demos, failures = [], []
        manager = ToolManager(MCPConfig(servers=servers)) if servers else contextlib.nullcontext()
        async with manager as tools:
            for line, task in entries:
                try:
                    demos.append(await demonstrate(task, tools, query_prompt=args.query_prompt,
                                                   images=parsed.images))
                except DemonstrationError as error:
                    failures.append(f"{args.tasks}:{line}: {error}")
        return demos, failures

    try:
        demos, failures = asyncio.run(build())
    except ToolConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if failures:
        return _report_invalid(failures, what="task")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    partial.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in demos), encoding="utf-8")
    partial.replace(out)  # a complete file or none
    calls = sum(len(d["messages"]) - 3 for d in demos) // 2
    print(f"wrote {len(demos)} demonstrations ({calls} real tool calls) to {out}; train on them with: "
          f"agentrl sft upload {out}")
    return 0
