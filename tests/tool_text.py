"""Tool calls as each format writes them (server.tools FORMATS), for the parser and grammar tests."""

from __future__ import annotations

import json
from typing import Any

from server.tools import ToolFormat


def tagged_call(fmt: ToolFormat, name: str, args: dict[str, Any]) -> str:
    """One call of a format with a tag per argument (strings bare, other values as JSON)."""
    tags = fmt.xml
    assert tags is not None
    nl = "\n" if tags.value_newlines else ""
    params = "".join(tags.key_open + k + tags.key_close + nl + (v if isinstance(v, str) else json.dumps(v))
                     + nl + tags.value_close for k, v in args.items())
    return (fmt.call_open + tags.function_open + name + tags.name_close + params + tags.function_close
            + fmt.call_close)


def calls_text(fmt: ToolFormat, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """The calls one after another, as the format writes them."""
    if fmt.xml is not None:
        return fmt.separator.join(tagged_call(fmt, n, a) for n, a in calls)
    if fmt.args_marker:  # Mistral v11+, harmony: no JSON wrapper
        seps = (",", ":") if fmt.compact_json else None
        return "".join(fmt.call_open + n + fmt.args_marker + json.dumps(a, separators=seps) for n, a in calls)
    key = fmt.args_keys[0]
    objs = [fmt.call_open + json.dumps({"name": n, key: a}) + fmt.call_close for n, a in calls]
    return fmt.list_open + fmt.separator.join(objs) + fmt.list_close
