"""Strings in parsed JSON that are not text: lone UTF-16 surrogates, found by path.

`json.loads` hands out a string holding a lone surrogate (U+D800..U+DFFF) for a `"\\ud800"` escape (valid JSON)
and, given bytes, for a surrogate's own three bytes (0xED 0xA0-0xBF ..: not UTF-8, yet decoded with
'surrogatepass'). No UTF-8 encodes such a string, so whoever encodes it later (a tokenizer, a response) fails.
The gateway refuses them in request bodies, and the `llm` runtime in the generation requests it is sent, each
naming the string's place.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A surrogate's escape (`\\uD8xx`..`\\uDFxx`, either case), or its UTF-8-like bytes (0xED then 0xA0-0xBF; 0xED
# alone also leads Hangul syllables, which need no walk).
_ESCAPED = re.compile(rb"\\u[dD][89a-fA-F]")
_RAW = re.compile(rb"\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")    # what no UTF-8 encodes; searched without a copy


def may_hold_surrogate(raw: bytes) -> bool:
    """False when the JSON text `raw` (UTF-8) cannot decode to a lone surrogate: the walk is then not needed."""
    return _ESCAPED.search(raw) is not None or _RAW.search(raw) is not None


def lone_surrogate(data: Any) -> str | None:
    """The path (`inputs[0].data[2]`, `messages[0].content`) of the first string or key in `data` that does not
    encode as UTF-8, if any; `body` for the top level.

    Depth first with one iterator per open container: numbers, booleans and None cost nothing, and the path is
    built only for the string found, so the walk's memory grows with the nesting depth, not the body's size."""
    if isinstance(data, str):
        return "body" if _SURROGATE.search(data) else None
    if not isinstance(data, (list, dict)):
        return None
    trail: list[int | str] = []              # the index or key of each open container but the top one
    open_: list[Iterator[tuple[Any, Any]]] = [_entries(data)]
    while open_:
        entry = next(open_[-1], None)
        if entry is None:
            open_.pop()
            if trail:
                trail.pop()
            continue
        key, value = entry
        if isinstance(key, str) and _SURROGATE.search(key):
            return f"{_path(trail) or 'body'} (a key)"
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return _path([*trail, key]) or "body"
        elif isinstance(value, (list, dict)):
            trail.append(key)
            open_.append(_entries(value))
    return None


def surrogate_message(path: str) -> str:
    return f"{path}: holds a lone UTF-16 surrogate, which is not text (send valid Unicode)"


def _entries(container: list[Any] | dict[str, Any]) -> Iterator[tuple[Any, Any]]:
    return iter(container.items()) if isinstance(container, dict) else enumerate(container)


def _path(trail: list[int | str]) -> str:
    path = ""
    for step in trail:
        path = f"{path}[{step}]" if isinstance(step, int) else _member(path, step)
    return path


def _member(path: str, key: str) -> str:
    if _IDENTIFIER.fullmatch(key):
        return f"{path}.{key}" if path else key
    shown = key if len(key) <= 24 else key[:24] + "..."
    return f"{path or 'body'}[{json.dumps(shown, ensure_ascii=False)}]"
