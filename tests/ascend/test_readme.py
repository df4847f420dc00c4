"""The op table of plugins/ascend_950/README.md says what op_plan says: every op once, on a stock
operator exactly where op_plan provides one (naming only operators npu_ops calls), TileLang only
where it is planned, the reference everywhere else."""

from __future__ import annotations

import re
from pathlib import Path

from deepinfer_ascend_950 import npu_ops, op_plan
from deepinfer_core.ops import OP_NAMES

README = Path(__file__).resolve().parents[2] / "plugins/ascend_950/README.md"


def _rows() -> dict[str, str]:
    text = README.read_text()
    table = text[text.index("| op | on the 950 | why / limits |"):].split("\n\n")[0].splitlines()[2:]
    rows: dict[str, str] = {}
    for line in table:
        ops_cell, provider, _ = line.strip("|").split("|")
        for op in re.findall(r"`(\w+)`", ops_cell):
            assert op not in rows, f"{op} twice"
            rows[op] = provider.strip()
    return rows


def test_the_readme_table_follows_the_plan():
    rows = _rows()
    assert set(rows) == set(OP_NAMES)
    for op, provider in rows.items():
        if op in op_plan.PROVIDES:
            named = set(re.findall(r"`(npu_\w+)`", provider))
            assert named and named <= set(npu_ops.OPERATORS), (op, provider)
        else:
            assert provider.startswith(("reference", "none")), (op, provider)
            assert ("TileLang" in provider) == (op in op_plan.TILELANG_PLANNED), (op, provider)
