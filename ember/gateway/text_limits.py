"""A contract's `limits.max_string_bytes` on the text a JSON route turns into one element of a BYTES input, checked
as soon as the text is parsed: before it is encoded, framed, sent to an instance or tokenized by the gateway's own
prompt check, with a 400 naming the request's field. A character is at least one byte of UTF-8 (and of JSON), so a
text with more characters than the limit is refused before any copy of it is made.

Without it a 60 MB prompt was serialized again, encoded and tokenized whole in the gateway (15.7 M tokens, 6 GB, 174 s)
before the instance refused the element for its size; an embedding input was framed and sent to its instance first.
"""

from __future__ import annotations

import re
from typing import Any

from ember.gateway.errors import ParamError
from ember.wire.contract import ModelContract
from ember.wire.tensors import string_too_long


def _refusal(contract: ModelContract, field: str, input_name: str, size: int, at_least: bool) -> ParamError:
    return ParamError(f"{field}: {string_too_long(contract, input_name, size, at_least)}",
                      re.split(r"[.\[]", field, maxsplit=1)[0])


def utf8_within(contract: ModelContract, text: str, field: str, input_name: str) -> bytes:
    """`text` as UTF-8, or a 400 naming `field` past the limit (decided by its length alone where that suffices)."""
    if len(text) > contract.limits.max_string_bytes:
        raise _refusal(contract, field, input_name, len(text), True)
    data = text.encode()
    if len(data) > contract.limits.max_string_bytes:
        raise _refusal(contract, field, input_name, len(data), False)
    return data


def check_text_length(contract: ModelContract, value: Any, field: str, input_name: str) -> None:
    """A 400 naming `field` when the characters of every string in `value` (a parsed JSON value: keys too) are past
    the limit together: the element it becomes holds them all, each in a byte at least."""
    limit = contract.limits.max_string_bytes
    chars, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            chars += len(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        if chars > limit:
            raise _refusal(contract, field, input_name, chars, True)
