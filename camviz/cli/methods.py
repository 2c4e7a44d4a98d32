"""``camviz methods``: the table of CAM methods, read from the registry."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from camviz.cams.base import CamMethod

# Families in the order the table shows them (see family()).
_FAMILIES = ("gradient CAM", "input gradients", "gradient-free CAM", "perturbation")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "methods",
        help="list the CAM methods",
        description="List the CAM methods by family, then name, with what each needs and "
        "where its paper appeared.",
    )
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="print the Markdown table of the README (registry order) instead",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from camviz import cams
    from camviz.cli.text import aligned, echo

    if args.markdown:
        echo(*cams.table().splitlines())
        return 0
    methods = sorted(
        (cams.get(name) for name in cams.names()),
        key=lambda cls: (_FAMILIES.index(family(cls)), cls.name),
    )
    rows = [[cls.name, family(cls), cls.needs, _venue(cls.paper)] for cls in methods]
    echo(*aligned(["method", "family", "needs", "published"], rows).splitlines())
    echo("", "Papers: `camviz methods --markdown`, or the README.")
    return 0


def family(cls: type[CamMethod]) -> str:
    """The family of a method, read off what it needs from the engine."""
    from camviz.cams.perturbation import PerturbationMethod

    if issubclass(cls, PerturbationMethod) or "pass" in cls.needs:
        return "perturbation"
    if "input gradients" in cls.needs:
        return "input gradients"
    if not cls.uses_gradients and cls.attention != "gradients":
        return "gradient-free CAM"
    return "gradient CAM"


def _venue(paper: str) -> str:
    """Where and when the paper appeared (``ICCV 2017``), or ``none`` for unpublished ones."""
    if paper.lower().startswith("no paper"):
        return "none"
    return paper.rsplit(",", 1)[-1].strip()
