"""``--set KEY=VALUE`` options of the grid benchmarks (``claims.py``, ``quality.py``).

Each changes one run option of every run of the grid; the value is read as JSON where it is
JSON (``2``, ``0.5``, ``true``, ``null``, ``[1, 2]``) and kept as text otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def json_or_text(text: str) -> Any:
    """``text`` read as JSON, or ``text`` itself where it is no JSON (``"topk"``, ``"a/b"``)."""
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_sets(items: Iterable[str], *, option_names: bool = False) -> dict[str, Any]:
    """Run options from ``KEY=VALUE`` words, values through :func:`json_or_text`.

    Args:
        items: the ``--set`` words, in order (a later one for the same key wins).
        option_names: strip each key and read ``-`` as ``_`` (``batch-size`` -> ``batch_size``),
            as a command-line option name; otherwise keys are kept as written.

    Returns:
        Key -> value, in first-seen key order. A word without ``=`` gives its text as the key
        and ``""`` as the value.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, _, value = item.partition("=")
        if option_names:
            key = key.strip().replace("-", "_")
        out[key] = json_or_text(value)
    return out
