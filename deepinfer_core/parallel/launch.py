"""Starting a data-parallel group: one process per rank, each with its own engine.

Two ways in, one group at the end (``Group``):

* **Spawned** (``LLM(..., data_parallel_size=N)`` in a plain process): this process is rank 0;
  it starts ranks 1..N-1 (``spawn`` start method: each runs backend discovery itself and picks
  its device by ``LOCAL_RANK``), builds its own engine meanwhile, and waits for every rank to
  report ready or failed through a ``TCPStore`` while watching the processes: a rank that dies
  while loading is reported with its rank and error, not waited on.
* **torchrun** (``WORLD_SIZE`` > 1 in the environment): every process runs the user's script;
  rank and device come from ``RANK`` / ``LOCAL_RANK``, the rendezvous from ``MASTER_ADDR`` /
  ``MASTER_PORT``, as DeepSeek's own harness launches.

The process group's backend follows the device: NCCL on CUDA, HCCL on Ascend, gloo on the CPU; a
second gloo group carries the small control messages (requests, outputs, the per-step flags).
Collectives time out after ``DEEPINFER_DIST_TIMEOUT`` seconds, except rank 0's commands to the
spawned ranks (a third gloo group, ``commands``): those ranks wait for the next command as long
as the LLM lives unused (a rank 0 that dies closes its sockets, which ends the wait at once).
"""

from __future__ import annotations

import datetime
import logging
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer_core.config import ConfigError, settings

log = logging.getLogger("deepinfer")
DIST_BACKENDS = {"cuda": "nccl", "npu": "hccl"}  # any other device: gloo
STORE_PREFIX = "deepinfer"
POLL_SECONDS = 0.5
IDLE_TIMEOUT = datetime.timedelta(days=365)  # how long a spawned rank waits for rank 0's next command


class RankFailure(RuntimeError):
    """A rank of the data-parallel group failed or died; the group is stopped."""


@dataclass
class Group:
    """This process's place in the group. ``processes``: the ranks this process started (rank 0
    in spawned mode), watched for deaths; ``store``: the rendezvous store (failure reports)."""

    rank: int
    size: int
    control: Any  # the gloo group for control messages
    processes: dict[int, Any] = field(default_factory=dict)
    store: Any = None
    broken: str | None = None  # why the group can no longer be used
    threads_before: int | None = None  # torch's CPU threads in this process before the group took its share
    commands: Any = None  # spawned groups: the gloo group rank 0's commands travel in (no idle timeout)

    @property
    def spawned(self) -> bool:
        return bool(self.processes)

    def exited(self) -> str | None:
        """The ranks this process started that are no longer running (a spawned rank runs until
        rank 0 stops it), with how each ended and the error it reported; None while all run.
        Reads their exit codes only: safe from any thread, while the group steps."""
        gone = {r: p.exitcode for r, p in list(self.processes.items())}
        gone = {r: code for r, code in gone.items() if code is not None}
        if not gone:
            return None
        return "; ".join(f"rank {r} died ({_exit_reason(code)}){_reported(self.store, r)}" for r, code in sorted(gone.items()))

    def failure(self, error: BaseException) -> RankFailure:
        """What went wrong when a collective failed: the rank that died or reported an error (its
        exit code and message), else ``error`` itself. Stops the ranks this process started."""
        deadline = time.monotonic() + 10  # a dead peer's exit code can lag behind the broken connection
        dead = {}
        while self.processes and time.monotonic() < deadline and not dead:
            dead = {r: p.exitcode for r, p in self.processes.items() if p.exitcode not in (None, 0)}
            if not dead:
                time.sleep(0.1)
        if dead:
            parts = [f"rank {r} died ({_exit_reason(code)}){_reported(self.store, r)}" for r, code in sorted(dead.items())]
            message = "; ".join(parts)
        else:
            message = f"{type(error).__name__}: {error}"
        self.stop()
        self.broken = message
        try:
            dist.destroy_process_group()  # so that a new LLM can start a group in this process
        except Exception:  # noqa: BLE001 - the broken group may not shut down cleanly; it is dropped either way
            pass
        return RankFailure(f"data-parallel group failed: {message}; the other ranks were stopped. Create a new LLM to go on")

    def stop(self, wait: float = 10.0) -> None:
        """End the ranks this process started (after they were asked to stop, or at once), and
        give this process its CPU threads back."""
        if self.threads_before is not None:
            torch.set_num_threads(self.threads_before)
            self.threads_before = None
        deadline = time.monotonic() + wait
        for process in self.processes.values():
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes.values():
            if process.is_alive():
                process.terminate()
                process.join(5)
        self.processes = {}


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "still running"
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def _reported(store, rank: int) -> str:
    """The error a rank wrote into the store before it exited, if any."""
    key = f"failed/{rank}"
    try:
        if store is not None and store.check([key]):
            return ": " + store.get(key).decode(errors="replace").strip()
    except Exception:  # noqa: BLE001 - the store may be gone with the ranks
        pass
    return ""


def report(store, rank: int, error: BaseException) -> None:
    """Leave a spawned rank's error in the store, where rank 0 finds it when the rank is gone."""
    try:
        store.set(f"failed/{rank}", f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=-4)}")
    except Exception:  # noqa: BLE001 - rank 0 may be gone too; the exit code still tells
        pass


def under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def dist_backend(device: torch.device) -> str:
    return DIST_BACKENDS.get(device.type, "gloo")


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=settings().dist_timeout)


def _host_threads(size: int) -> int:
    """On the CPU every rank shares the host's cores: each takes its share of torch's threads.
    Returns the number of threads before."""
    before = torch.get_num_threads()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cpus // size))
    return before


def torchrun_rank(size: int) -> int:
    """This process's rank under torchrun (``RANK``), once ``WORLD_SIZE`` is checked to equal ``size``."""
    world = int(os.environ["WORLD_SIZE"])
    if world != size:
        raise ConfigError(f"data_parallel_size={size} but torchrun started WORLD_SIZE={world} processes; make them equal "
                          "(or leave data_parallel_size unset under torchrun)")
    return int(os.environ["RANK"])


def join_torchrun(device: torch.device, size: int) -> Group:
    """This process's rank of a group launched by torchrun (``WORLD_SIZE`` must equal ``size``)."""
    torchrun_rank(size)
    if not dist.is_initialized():
        dist.init_process_group(dist_backend(device), timeout=_timeout(),
                                **({"device_id": device} if device.type == "cuda" else {}))
    if device.type == "cpu":
        _host_threads(size)
    return Group(dist.get_rank(), size, dist.new_group(backend="gloo", timeout=_timeout()))


def spawn(size: int, worker: Callable, worker_args: tuple, build: Callable[[], Any]) -> tuple[Group, Any]:
    """Start ranks 1..size-1 (each runs ``worker(rank, size, port, *worker_args)``), run ``build()``
    here meanwhile (rank 0's engine), wait for every rank to be ready, join the process group.
    Returns (the group, what ``build`` returned). A rank that fails to start is reported with
    its rank and error, and the others are stopped."""
    if dist.is_initialized():
        raise ConfigError("torch.distributed is already initialised in this process: launch with torchrun (every rank runs "
                          "your script) or create the LLM in a process without a process group")
    store = dist.TCPStore("127.0.0.1", 0, size, True, _timeout(), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    processes = {}
    group = Group(0, size, None, processes, store)
    try:
        for rank in range(1, size):
            process = ctx.Process(target=worker, args=(rank, size, store.port, *worker_args), daemon=True,
                                  name=f"deepinfer-rank{rank}")
            process.start()
            processes[rank] = process
        built = build()
        _wait_ready(group, range(1, size))
        device = getattr(built, "device", torch.device("cpu"))
        dist.init_process_group(dist_backend(device), store=dist.PrefixStore(STORE_PREFIX, store), rank=0, world_size=size,
                                timeout=_timeout())
        if device.type == "cpu":
            group.threads_before = _host_threads(size)
        group.control = dist.new_group(backend="gloo", timeout=_timeout())
        group.commands = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    except BaseException:
        group.stop(wait=0)
        raise
    return group, built


def _wait_ready(group: Group, ranks) -> None:
    store, pending = group.store, set(ranks)
    deadline = time.monotonic() + settings().dist_timeout
    while pending:
        for rank in sorted(pending):
            if store.check([f"failed/{rank}"]):
                raise RankFailure(f"rank {rank} failed to start{_reported(store, rank)}")
            if store.check([f"ready/{rank}"]):
                pending.discard(rank)
                continue
            code = group.processes[rank].exitcode
            if code is not None:
                why = _reported(store, rank) or (
                    " before it reached DeepInfer (its stderr says why). Ranks are started with the 'spawn' method, "
                    "which imports your main script again in every rank: create the LLM under "
                    "`if __name__ == \"__main__\":`")
                raise RankFailure(f"rank {rank} died while starting ({_exit_reason(code)}){why}")
        if pending and time.monotonic() > deadline:
            raise RankFailure(f"ranks {sorted(pending)} did not start within DEEPINFER_DIST_TIMEOUT={settings().dist_timeout} s")
        if pending:
            time.sleep(POLL_SECONDS)


def worker_join(rank: int, size: int, port: int, build: Callable[[], Any]) -> tuple[Group, Any]:
    """In a spawned rank: build its engine (``build``), report ready (or the error, then exit),
    join the process group. Returns (the group, what ``build`` returned)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))  # the backend picks its device by LOCAL_RANK
    store = dist.TCPStore("127.0.0.1", port, size, False, _timeout())
    try:
        built = build()
    except BaseException as e:
        report(store, rank, e)
        raise SystemExit(1) from None
    store.set(f"ready/{rank}", "1")
    device = getattr(built, "device", torch.device("cpu"))
    dist.init_process_group(dist_backend(device), store=dist.PrefixStore(STORE_PREFIX, store), rank=rank, world_size=size,
                            timeout=_timeout())
    if device.type == "cpu":
        _host_threads(size)
    control = dist.new_group(backend="gloo", timeout=_timeout())
    return Group(rank, size, control, store=store, commands=dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)), built
