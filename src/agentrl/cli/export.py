"""`agentrl export`: one JSON line per Record with its turns (OpenAI messages or AgentGym conversations)."""

from __future__ import annotations

import argparse

from agentrl.cli.options import add_db_option


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("export", help="export trajectories as JSONL (for audits and SFT)")
    add_db_option(parser)
    parser.add_argument("--out", required=True, help="output file (JSONL)")
    parser.add_argument("--format", choices=("messages", "agentgym"), default="messages",
                        help="messages: OpenAI chat messages; agentgym: conversations with from/value/loss")
    parser.add_argument("--split", default=None, help="only Records of this split")
    parser.add_argument("--status", default=None,
                        help="only Records in these states, comma-separated (e.g. scored,ready,trained)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from agentrl.log import redact
    from agentrl.store import database_name, resolve_connection_string, sync_client
    from agentrl.store.export import ImageFiles, write_export

    uri = resolve_connection_string(args.db_connection_string)
    statuses = [s.strip() for s in args.status.split(",") if s.strip()] if args.status else None
    client = sync_client(uri)
    out = Path(args.out)
    tmp = out.with_name(out.name + ".partial")
    try:
        db = client[database_name(uri)]
        images = ImageFiles(db, out.with_name(out.name + ".images"), out.parent)
        with tmp.open("w", encoding="utf-8") as handle:
            count = write_export(db, handle, fmt=args.format, split=args.split, statuses=statuses, images=images)
        tmp.replace(out)
    finally:
        client.close()
        tmp.unlink(missing_ok=True)
    pictures = f" and {len(images.written)} images to {images.directory}" if images.written else ""
    print(f"exported {count} records from {redact(uri)} to {out}{pictures}")
    return 0
