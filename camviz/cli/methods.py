"""``camviz methods``: the table of CAM methods, read from the registry."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "methods", help="list the CAM methods", description="List the CAM methods by name."
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from camviz import cams

    print(cams.table())
    return 0
