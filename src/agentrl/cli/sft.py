"""`agentrl sft upload FILE`: tokenise SFT conversations with the model's chat template and queue them as training
samples (loss on assistant tokens only) for ``agentrl train --loss_calculater CrossEntropy --enable_sampling false``."""

from __future__ import annotations

import argparse
import sys

from agentrl.cli.options import add_db_option


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
        from agentrl.inference.embedded_model import policy_tokenizer

        tokenizer = policy_tokenizer(args.model_name_or_path)
    except (OSError, ValueError) as error:
        print(f"error: cannot load the tokenizer of {args.model_name_or_path}: {error}", file=sys.stderr)
        return 2
    options = SFTOptions(split=args.split, max_length=args.max_length,
                         overlong="truncate" if args.truncate else "reject")
    try:
        parsed = parse_sft_file(args.file, tokenizer, options)
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


def _report_invalid(problems: list[str]) -> int:
    for problem in problems:
        print(problem, file=sys.stderr)
    count = len(problems)
    print(f"error: {count} invalid line{'' if count == 1 else 's'}; nothing was inserted (use --skip_invalid to "
          "insert the valid ones)", file=sys.stderr)
    return 2
