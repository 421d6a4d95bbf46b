"""The one parser of the versioned one-line states that ``Loss_scaler`` and the recipes write
(``ocannl.<Kind>/<version> <fields>``), so both refuse another version and a malformed line with
the same words."""

from __future__ import annotations

import re

from ocannl.errors import Failure

__all__ = ["parse_state"]


def parse_state(s: object, *, kind: str, version: str, fields: str, expected: str,
                who: str) -> re.Match[str]:
    """The match of ``s`` against ``ocannl.<kind>/<version> <fields>`` (``fields``: a regular
    expression, whose groups the caller reads), or ``ocannl.Failure`` prefixed by ``who``: one
    naming the version when ``s`` is a ``kind`` state of another one, else one quoting
    ``expected``. A line of another version is named as such, not as garbage: a resume from an
    older checkpoint then says why it cannot continue."""
    line = s if isinstance(s, str) else None
    head = rf"ocannl\.{re.escape(kind)}/"
    found = None if line is None else re.match(rf"{head}([0-9]{{1,6}})(?: |$)", line, re.ASCII)
    if found is not None and found[1] != version:
        raise Failure(f"{who}: {s!r:.200} is a state of format ocannl.{kind}/{found[1]}, which "
                      f"this version does not read: expected format version {version}, "
                      f"{expected}")
    m = None if line is None else re.fullmatch(rf"{head}{version} {fields}", line, re.ASCII)
    if m is None:
        raise Failure(f"{who}: {s!r:.200} is not a {kind} state: expected {expected}")
    return m
