"""Multi-process pieces: ``eplb`` (where expert copies live), ``communicator`` (collectives over
torch.distributed, or the backend's own), ``expert_parallel`` (one MoE layer across an EP
group), ``context_parallel`` (zig-zag chunks, the log-sum-exp merge of partial attention). The
engine does not launch several processes yet.

This module itself must stay cheap to import: backend probe modules use ``local_rank``.
"""

from __future__ import annotations

import os


def local_rank() -> int:
    """This process's device index on its host: ``LOCAL_RANK`` under a multi-process launcher
    (torchrun and the like), else 0. A malformed value is an error, never a silent 0."""
    raw = os.environ.get("LOCAL_RANK", "0").strip() or "0"
    try:
        index = int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_RANK={raw!r} is not an integer") from None
    if index < 0:
        raise ValueError(f"LOCAL_RANK={raw!r} is negative")
    return index
