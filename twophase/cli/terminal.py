"""Printing to the terminal. Text from a model, a user or a file is printed as text: Rich would read
``[bold]`` in it as markup (and fail on ``[/]``) and ``a[i]`` as a tag it swallows. So every console
here reads no markup, and only our own labels carry a style, as ``Text`` spans."""

from __future__ import annotations

from rich.console import Console
from rich.text import Text


def console(stderr: bool = False) -> Console:
    """A console that prints strings as they are (no markup, no highlighting)."""
    return Console(markup=False, highlight=False, stderr=stderr)


def styled(*parts: str | tuple[str, str]) -> Text:
    """Plain strings as they are, ``(text, style)`` pairs styled: ``styled(("no", "red"), ": ", why)``."""
    return Text.assemble(*parts)
