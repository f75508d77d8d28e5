"""The documentation's citations of metalearn's own code resolve, and the defaults it states
are the learners' constructors' defaults.

Three conventions, which docs/algorithms.md's opening paragraph states:

* metalearn's code is cited by symbol, never by line: a backticked dotted name starting
  ``metalearn.`` (``metalearn.algorithms.reptile.Reptile.adapt``) names a module and an
  attribute path in it, which must exist; a path into the package (``metalearn/...py``)
  followed by a line number is refused, and so is any ``.py`` line number in the metalearn
  column of docs/algorithms.md's line-by-line tables (``| their line | metalearn |``).
  References' files keep their line numbers: they are pinned to a commit.
* a backticked call of a registered learner class with keywords,
  ``Reptile(inner_loss="sum")``, states those arguments' defaults: each keyword is a
  parameter of the constructor (or of a base class its ``**kwargs`` reach) whose default is
  that literal (``Reptile(argument=default)``, a column's header, states none).
* docs/algorithms.md's first table states each algorithm's defaults in its ``inner lr``,
  ``inner steps (train)`` and ``outer`` columns, each cell starting with the value (``-``:
  none): the constructor's ``inner_lr`` and ``inner_steps`` defaults, the class's outer
  optimizer and step (``Adam 1e-3``, ``SGD 1.0``).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from metalearn.algorithms.base import MetaLearner
from metalearn.algorithms.registry import LEARNERS, can
from tests.conftest import ROOT

DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
ALGORITHMS = ROOT / "docs" / "algorithms.md"
# a backticked span; the symbol at its start
SPAN = re.compile(r"`([^`\n]+)`")
SYMBOL = re.compile(r"^metalearn(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
FILE_SUFFIXES = {"json", "pt", "pt2", "yaml", "yml", "txt", "md", "py"}  # `metalearn.json`
LINE_OF_OWN_FILE = re.compile(r"metalearn/[\w/]+\.py`?,?\s*(?:lines?\s*)?\d")
LINE_OF_A_FILE = re.compile(r"\.py`?,?\s*(?:lines?\s*)?\d")
CLASSES: dict[str, type] = {cls.__name__: cls for cls in LEARNERS.values()}
CLASSES["MetaLearner"] = MetaLearner
CALL = re.compile(r"^(" + "|".join(CLASSES) + r")\((.*)\)$")
PLACEHOLDER = "argument=default"  # a column header: `Reptile(argument=default)`


def spans(path: Path) -> list[tuple[int, str]]:
    """Every backticked span of a document, with its line number (code blocks included)."""
    return [(n, m.group(1)) for n, line in enumerate(path.read_text().splitlines(), 1)
            for m in SPAN.finditer(line)]  # fmt: skip


def resolve(symbol: str) -> Any:
    """The object a dotted name names: the longest importable module prefix, then attributes.

    Raises:
        LookupError: no such module or attribute (naming where the lookup stopped).
    """
    parts = symbol.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for i, name in enumerate(parts[cut:], cut):
            if not hasattr(target, name):
                raise LookupError(f"{'.'.join(parts[:i])} has no attribute {name!r}")
            target = getattr(target, name)
        return target
    raise LookupError(f"no module {parts[0]!r}")


def citations() -> list[tuple[str, int, str]]:
    """(document, line, symbol) of every citation of metalearn's code by name."""
    found = []
    for path in DOCS:
        for line, text in spans(path):
            match = SYMBOL.match(text.strip())
            if match and match.group(0).rsplit(".", 1)[-1] not in FILE_SUFFIXES:
                found.append((path.name, line, match.group(0)))
    return found


def test_every_citation_of_metalearns_code_names_a_symbol_that_exists():
    cited = citations()
    assert len(cited) > 50  # the scan finds the docs' citations
    missing = []
    for document, line, symbol in cited:
        try:
            resolve(symbol)
        except LookupError as err:
            missing.append(f"{document}:{line}: `{symbol}`: {err}")
    assert not missing, "\n".join(missing)


def test_the_resolver_fails_on_what_does_not_exist():
    assert resolve("metalearn.algorithms.reptile.Reptile.adapt") is not None
    for stale in ("metalearn.algorithms.reptile.Reptile.no_such_method",
                  "metalearn.no_such_module.thing"):  # fmt: skip
        with pytest.raises(LookupError):
            resolve(stale)


def _table_rows(path: Path) -> list[tuple[int, list[str], list[str]]]:
    """(line, header cells, row cells) of every row of every markdown table in ``path``."""
    rows, header = [], None
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not set("".join(cells)) <= set("-: "):
            rows.append((n, header, cells))
    return rows


def test_no_document_cites_metalearns_own_code_by_line():
    stale = []
    for path in DOCS:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if LINE_OF_OWN_FILE.search(line):
                stale.append(f"{path.name}:{n}: {LINE_OF_OWN_FILE.search(line).group(0)}")
    for n, header, cells in _table_rows(ALGORITHMS):
        if header[:2] == ["their line", "metalearn"] and LINE_OF_A_FILE.search(cells[1]):
            stale.append(f"algorithms.md:{n}: {LINE_OF_A_FILE.search(cells[1]).group(0)}")
    assert not stale, "cite metalearn's code by symbol, not line:\n" + "\n".join(stale)


def default_of(cls: type, argument: str) -> Any:
    """``argument``'s default in ``cls``'s constructor, following ``**kwargs`` up the MRO.

    Raises:
        LookupError: no constructor on the way takes it, or it has no default.
    """
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        parameters = inspect.signature(klass.__init__).parameters
        if argument in parameters:
            default = parameters[argument].default
            if default is inspect.Parameter.empty:
                raise LookupError(f"{klass.__name__}'s {argument} has no default")
            return default
        if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            break
    raise LookupError(f"{cls.__name__} takes no argument {argument!r}")


def stated_defaults() -> list[tuple[str, int, str, str, Any]]:
    """(document, line, class, argument, value) of every ``Learner(argument=value)``."""
    found = []
    for path in DOCS:
        for line, text in spans(path):
            match = CALL.match(text.strip())
            if not match or match.group(2) == PLACEHOLDER:  # a table header's form
                continue
            call = ast.parse(text.strip(), mode="eval").body
            for keyword in call.keywords:
                value = ast.literal_eval(keyword.value)
                found.append((path.name, line, match.group(1), keyword.arg, value))
    return found


def test_every_stated_default_is_the_constructors():
    stated = stated_defaults()
    assert len(stated) > 20  # the scan finds the docs' statements
    wrong = []
    for document, line, name, argument, value in stated:
        try:
            default = default_of(CLASSES[name], argument)
        except LookupError as err:
            wrong.append(f"{document}:{line}: {name}({argument}=...): {err}")
            continue
        if type(default) is not type(value) and not (
            isinstance(default, (int, float)) and isinstance(value, (int, float))
        ):
            wrong.append(f"{document}:{line}: {name}({argument}={value!r}), default {default!r}")
        elif default != value:
            wrong.append(f"{document}:{line}: {name}({argument}={value!r}), default {default!r}")
    assert not wrong, "\n".join(wrong)


def test_the_default_check_fails_on_a_wrong_value():
    from metalearn.algorithms import Reptile

    assert default_of(Reptile, "inner_loss") == "sum"
    assert default_of(Reptile, "on_nonfinite") == "raise"  # through **kwargs to MetaLearner
    with pytest.raises(LookupError, match="takes no argument"):
        default_of(Reptile, "no_such_argument")


def _leading(cell: str) -> str:
    """The value a cell starts with (its first word, a trailing comma dropped)."""
    return cell.split()[0].rstrip(",") if cell.split() else ""


def test_the_first_table_states_each_learners_inner_and_outer_defaults():
    """docs/algorithms.md's first table: inner lr, inner steps and outer of every row."""
    rows = [(n, h, c) for n, h, c in _table_rows(ALGORITHMS) if h[:2] == ["algorithm", "inner lr"]]
    assert {c[0].strip("`") for _, _, c in rows} == set(LEARNERS)  # one row per algorithm
    wrong = []
    for n, header, cells in rows:
        name = cells[0].strip("`")
        cls = LEARNERS[name]
        column = dict(zip(header, cells, strict=True))
        for title, argument in (("inner lr", "inner_lr"), ("inner steps (train)", "inner_steps")):
            stated = _leading(column[title])
            try:
                default = default_of(cls, argument)
            except LookupError:
                default = None
            if stated == "-":
                ok = not can(name, "inner_loop")
            else:
                ok = default is not None and float(stated) == float(default)
            if not ok:
                wrong.append(f"algorithms.md:{n}: {name} {title} {stated}, default {default}")
        optimizer, lr = column["outer"].split()[:2]
        own = (cls.default_outer_optimizer, cls.default_outer_lr)
        if (optimizer.lower(), float(lr.rstrip(","))) != own:
            wrong.append(f"algorithms.md:{n}: {name} outer {optimizer} {lr}, default {own}")
    assert not wrong, "\n".join(wrong)
