"""Multi-process pieces: ``launch`` (spawned ranks or torchrun's, failures), ``data_parallel``
(each rank's engine stepping in lock-step, requests spread by load, CP prefills, EPLB
schedule), ``eplb`` (where expert copies live), ``communicator`` (collectives over
torch.distributed, or the backend's own), ``expert_parallel`` (MoE layers across an EP group),
``context_parallel`` (zig-zag chunks, the gathered-latent prefill, the log-sum-exp merge).

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
