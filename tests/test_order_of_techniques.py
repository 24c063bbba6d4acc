"""docs/architecture.md's "Order of techniques" is the one list of the steps, each with a name; the code
and the other documents refer to a step by that name. ``parallelize`` marks each step it runs with
the name, in the documented order, so the list and the code cannot drift apart unnoticed."""

from __future__ import annotations

import inspect
import re

from lightning_par.parallel.parallelize import parallelize
from tests.helpers import ROOT


def documented_steps() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## Order of techniques"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(r"^\d+\. \*\*(.+?)\*\*", section, flags=re.M)


def test_the_documented_steps_are_named_once_each():
    steps = documented_steps()
    assert len(steps) >= 10 and len(set(steps)) == len(steps), steps
    assert steps[0] == "build on meta" and steps[-1] == "build optimizer", steps


def test_parallelize_runs_the_documented_steps_in_their_order():
    """Every step from **build on meta** to **materialise** is a ``# <name>`` marker in ``parallelize``,
    in the documented order; the steps after it (DDP, optimizer) are the strategy's, not in it."""
    steps = documented_steps()
    inside = steps[:steps.index("materialise") + 1]
    source = inspect.getsource(parallelize)
    where = {name: [m.start() for m in re.finditer(rf"# {re.escape(name)}\b", source)] for name in steps}
    assert all(where[name] for name in inside), {n: p for n, p in where.items() if n in inside and not p}
    assert not any(where[name] for name in steps[len(inside):]), where
    first = [where[name][0] for name in inside]
    assert first == sorted(first), dict(zip(inside, first))
