"""`agentrl tasks upload FILE`: validate a JSON/JSONL task file and insert its Tasks (idempotently)."""

from __future__ import annotations

import argparse
import sys

from agentrl.cli.options import add_db_option
from agentrl.scoring.answers import ANSWER_SCHEMAS


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("tasks", help="manage Tasks")
    actions = parser.add_subparsers(dest="tasks_action", metavar="ACTION", required=True)
    upload = actions.add_parser(
        "upload", help="upload a JSON or JSONL task file",
        description="Validate every entry first: if any is invalid, report each as FILE:LINE and insert nothing "
                    "(unless --skip_invalid). Re-uploading a file does not duplicate tasks.")
    upload.add_argument("file", help="tasks as JSONL (one object per line) or JSON (a list of objects)")
    add_db_option(upload)
    upload.add_argument("--split", default="train", help="split the tasks belong to (default: train)")
    upload.add_argument("--num_generations", type=int, default=None,
                        help="samples per task, the GRPO group size (default: 8 for train, 1 for other splits)")
    upload.add_argument("--scorer", default="agentcpm",
                        help="scorer for tasks that do not name one (default: agentcpm, the LLM judge)")
    upload.add_argument("--answer_schema", choices=ANSWER_SCHEMAS, default="answer",
                        help="how the final answer is marked for tasks that do not say (default: answer)")
    upload.add_argument("--max_attempts", type=int, default=3,
                        help="attempts per sample slot before it is given up (default: 3)")
    upload.add_argument("--skip_invalid", action="store_true", help="insert the valid entries, report the others")
    upload.set_defaults(func=run_upload)


def run_upload(args: argparse.Namespace) -> int:
    from agentrl.log import redact
    from agentrl.store import database_name, resolve_connection_string, sync_client
    from agentrl.store.indexes import ensure_indexes_sync
    from agentrl.store.task_files import TaskFileError, UploadDefaults, upload_tasks

    if args.num_generations is not None and args.num_generations < 1:
        print("error: --num_generations must be at least 1", file=sys.stderr)
        return 2
    defaults = UploadDefaults(split=args.split, num_generations=args.num_generations, scorer=args.scorer,
                              answer_schema=args.answer_schema, max_attempts=args.max_attempts)
    uri = resolve_connection_string(args.db_connection_string)
    client = sync_client(uri)
    try:
        db = client[database_name(uri)]
        ensure_indexes_sync(db)
        try:
            result = upload_tasks(db, args.file, defaults, skip_invalid=args.skip_invalid)
        except TaskFileError as error:
            for problem in error.problems:
                print(problem, file=sys.stderr)
            print(f"error: {len(error.problems)} invalid entr{'y' if len(error.problems) == 1 else 'ies'}; "
                  "nothing was inserted (use --skip_invalid to insert the valid ones)", file=sys.stderr)
            return 2
    finally:
        client.close()
    for problem in result.problems:
        print(problem, file=sys.stderr)
    print(f"inserted {result.inserted} tasks into {redact(uri)} (split {args.split}); "
          f"{result.already_present} already present, {len(result.problems)} invalid skipped")
    if result.changed:
        print(f"warning: {len(result.changed)} tasks already present differ from the file and were left as they "
              f"are (e.g. {result.changed[0]})", file=sys.stderr)
    return 0
