"""What the documentation build adds to mkdocs and to griffe, the reader of partime's docstrings.

- ``on_config`` (an mkdocs hook): the site shows the version of the installed ``partime``
  distribution in its footer (``copyright``) and as ``config.extra.version``, so the pages say which
  release they document.
- ``DoctestBlocks`` (a griffe extension, named in mkdocs.yml): partime's docstrings show doctest
  examples as bare ``>>>`` lines, as the doctest module reads them; on the site each run of such
  lines, with the output under it, becomes a ``pycon`` code block instead of nested quotes.
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import griffe

_EXAMPLE_START = re.compile(r"^(\s*)>>>")


def on_config(config: Any) -> Any:
    """Put the installed partime's version into the site's footer and ``extra.version``."""
    try:
        release = version("partime")
    except PackageNotFoundError:  # a checkout that was never installed
        release = "unreleased"
    config.extra["version"] = release
    config.copyright = f"partime {release}"
    return config


def fence_doctests(text: str) -> str:
    """``text`` with each doctest example (a ``>>>`` line up to the next blank line) in a pycon fence."""
    out: list[str] = []
    indent: str | None = None  # the indentation of the open example, None outside one
    in_fence = False
    for line in text.split("\n"):
        if indent is None and line.lstrip().startswith("```"):
            in_fence = not in_fence
        start = None if in_fence or indent is not None else _EXAMPLE_START.match(line)
        if start:
            indent = start.group(1)
            out.append(f"{indent}```pycon")
        elif indent is not None and not line.strip():
            out.append(f"{indent}```")
            indent = None
        out.append(line)
    if indent is not None:
        out.append(f"{indent}```")
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    """Fence the bare doctest examples of every docstring griffe reads (see ``fence_doctests``)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(obj.docstring.value)
