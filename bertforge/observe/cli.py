"""``bertforge report``: its parser and handler (matplotlib is imported when it runs)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def cmd_report(args: argparse.Namespace, extra: list[str]) -> int:
    from .report import write_report

    write_report(args.runs, args.out, overwrite=args.overwrite)
    return 0


def add_report_command(sub: Any) -> None:
    """``bertforge report``: registered by cli.py."""
    p = sub.add_parser("report", help="figures and one HTML page for runs, from their metrics.jsonl and config.yaml",
                       description="Write DIR/index.html (figures embedded) and DIR/*.png for one or more run "
                                   "directories, overlaid, with a summary table and the config values they differ in.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories (pretrain or squad train)")
    p.add_argument("--out", required=True, type=Path, help="output directory: new or empty, unless --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty OUT (other files stay; never a live run's)")
    p.set_defaults(func=cmd_report)
