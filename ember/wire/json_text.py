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
from typing import Any

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A surrogate's escape (`\\uD8xx`..`\\uDFxx`, either case), or its UTF-8-like bytes (0xED then 0xA0-0xBF; 0xED
# alone also leads Hangul syllables, which need no walk).
_ESCAPED = re.compile(rb"\\u[dD][89a-fA-F]")
_RAW = re.compile(rb"\xed[\xa0-\xbf]")


def may_hold_surrogate(raw: bytes) -> bool:
    """False when the JSON text `raw` (UTF-8) cannot decode to a lone surrogate: the walk is then not needed."""
    return _ESCAPED.search(raw) is not None or _RAW.search(raw) is not None


def lone_surrogate(data: Any) -> str | None:
    """The path (`inputs[0].data[2]`, `messages[0].content`) of the first string or key in `data` that does not
    encode as UTF-8, if any; `body` for the top level."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str) and not _utf8(value):
            return path or "body"
        if isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, dict):
            for key, item in value.items():
                if not _utf8(key):
                    return f"{path or 'body'} (a key)"
                stack.append((_member(path, key), item))
    return None


def surrogate_message(path: str) -> str:
    return f"{path}: holds a lone UTF-16 surrogate, which is not text (send valid Unicode)"


def _member(path: str, key: str) -> str:
    if _IDENTIFIER.fullmatch(key):
        return f"{path}.{key}" if path else key
    shown = key if len(key) <= 24 else key[:24] + "..."
    return f"{path or 'body'}[{json.dumps(shown, ensure_ascii=False)}]"


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
