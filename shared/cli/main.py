"""The `baton` command line."""

from __future__ import annotations

import argparse
import logging
import sys

from shared.cli import (
    autoscale_cmd,
    certs_cmd,
    generate_cmd,
    healthcheck_cmd,
    make_tiny_cmd,
    plan_cmd,
    profile_cmd,
    service_cmds,
    train_draft_cmd,
    up_cmd,
)
from shared.errors import BatonError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description="Disaggregated prefill/decode LLM serving")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    generate_cmd.register(sub)
    up_cmd.register(sub)
    service_cmds.register(sub)
    train_draft_cmd.register(sub)
    make_tiny_cmd.register(sub)
    healthcheck_cmd.register(sub)
    certs_cmd.register(sub)
    profile_cmd.register(sub)
    plan_cmd.register(sub)
    autoscale_cmd.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args) or 0)
    except BatonError as e:
        print(f"baton: error: {e.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
