"""JSON that strict parsers accept, for the conformance reports.

``json.dump`` writes non-finite floats as the bare constants ``Infinity`` / ``NaN``, which are
not JSON (jq, JavaScript's JSON.parse and most CI tools reject the file); a report has them
whenever an op failed hard (its worst error is inf). Here they are written as the strings
"inf", "-inf" and "nan" instead, and ``allow_nan=False`` guarantees nothing else slips through.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _name(value: float) -> str | float:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _finite(obj: Any) -> Any:
    """``obj`` with every non-finite float (values and dict keys, at any depth) replaced by its name."""
    if isinstance(obj, float):
        return _name(obj)
    if isinstance(obj, dict):
        return {(_name(k) if isinstance(k, float) else k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):  # json writes tuples as lists too
        return [_finite(v) for v in obj]
    return obj


def dumps(obj: Any) -> str:
    """``obj`` as JSON text: indent 2, sorted keys, non-finite floats as "inf" / "-inf" / "nan",
    anything json cannot encode as ``str(value)``. Written with ``allow_nan=False``: a non-finite
    float the conversion missed raises ValueError instead of becoming a bare constant."""
    return json.dumps(_finite(obj), indent=2, sort_keys=True, default=str, allow_nan=False)


def write(obj: Any, path: str | Path) -> None:
    """``dumps(obj)`` to ``path`` (overwritten), with a final newline."""
    Path(path).write_text(dumps(obj) + "\n")
