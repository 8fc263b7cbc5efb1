"""The tensor-parallel process group: collectives, the step broadcast, and starting the ranks.

Two ways to get N ranks, both on `torch.distributed` with the gloo backend (CPU):

- ``torchrun --nproc-per-node N -m nextoken serve --tensor-parallel-size N ...`` (and
  torchrun's ``--nnodes`` / ``--rdzv-endpoint`` across hosts): every process runs the command;
  rank 0 serves, the others load their shard and follow (`ModelRunner.follow`);
- ``nextoken serve --tensor-parallel-size N`` (or ``LLM(..., tensor_parallel_size=N)``) alone:
  rank 0 starts ranks 1..N-1 on this machine (``python -m nextoken.runner.follower``, so a
  user's script is never re-imported) and meets them on a free loopback port.

On one machine each rank is pinned to its own slice of the cores (``os.sched_setaffinity``),
and its threads default to that slice. Two groups connect the ranks: the compute group, whose
collectives time out after `COLLECTIVE_TIMEOUT_S` (a rank that died or hangs ends the step with
`TensorParallelError` instead of a hang), and the command group, on which the followers wait
for rank 0's next step without a deadline (an idle server is not a failure; rank 0 exiting
closes its sockets, which ends the wait at once). Rank 0 checks the followers it started itself
before each step (a `waitpid` each): one that exited fails the step at once, naming its rank and
status, rather than leaving gloo to notice the closed connection (which under load has taken
the collective timeout). Under torchrun the launcher watches its processes.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import socket
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from nextoken.errors import EngineError, InvalidRequest

log = logging.getLogger("nextoken.distributed")

COLLECTIVE_TIMEOUT_S = 60  # a collective unfinished after this many seconds fails the step
IDLE_TIMEOUT = timedelta(days=3650)  # followers wait this long for the next step
FOLLOWER_EXIT_S = 10  # a follower told to stop has this long to exit before it is killed
EXCHANGE_MAX_RANKS = 4  # up to this many ranks, all-reduce by one exchange of the parts (`all_reduce`)


class TensorParallelError(EngineError):
    """A collective failed: another rank exited, or did not answer within the timeout."""


class TensorParallel:
    """This process's place in the group (`rank` of `size`) and the collectives the sharded
    layers call. `stats` counts each kind of collective and the seconds spent in it
    (``{"all_reduce": [calls, seconds], "all_gather": [...], "broadcast": [...]}``)."""

    def __init__(self, rank: int, size: int, cores: set[int] | None = None,
                 followers: dict[int, subprocess.Popen] | None = None):
        self.rank, self.size = rank, size
        self.cores = cores  # the cores this process had before it was pinned (restored by `close`)
        self.followers = followers or {}  # rank -> its process, for the ranks this one started
        self.commands = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self.stats = {"all_reduce": [0, 0.0], "all_gather": [0, 0.0], "broadcast": [0, 0.0]}
        self.closed = False

    def _count(self, kind: str, t0: float) -> None:
        s = self.stats[kind]
        s[0] += 1
        s[1] += time.perf_counter() - t0

    def _fail(self, what: str, exc: Exception) -> TensorParallelError:
        # gloo's message without its source location and advice: "Connection closed by peer [ip]:port"
        reason = re.sub(r"^\[[^\]]*\.cc:\d+\] ", "", str(exc).splitlines()[0]).split(". ")[0]
        return TensorParallelError(f"tensor parallel rank {self.rank}: {what} failed ({reason}); another rank "
                                   f"exited or did not answer within {COLLECTIVE_TIMEOUT_S} s")

    # -- what the sharded layers call -------------------------------------------------------
    def exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x` (same shape and dtype on each), in rank order: one isend and one
        irecv per peer, all in flight at once."""
        parts = [x if r == self.rank else torch.empty_like(x) for r in range(self.size)]
        works = [op(t, r) for r in range(self.size) if r != self.rank
                 for op, t in ((dist.isend, x), (dist.irecv, parts[r]))]
        for w in works:
            w.wait()
        return parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (same shape on each), summed in float32 in rank order (so
        every rank holds the same bits), in x's dtype.

        Up to `EXCHANGE_MAX_RANKS` ranks the partial sums are exchanged (`exchange`) and added
        here: one round of messages. gloo's ring all-reduce (`all_reduce_gloo`, the reference)
        needs more rounds, and was slower inside decode steps (docs/benchmarks.md).
        """
        if self.size > EXCHANGE_MAX_RANKS:
            return self.all_reduce_gloo(x)
        t0 = time.perf_counter()
        y = x.float().contiguous()
        try:
            parts = self.exchange(y)
        except (RuntimeError, dist.DistError) as exc:
            raise self._fail("all-reduce", exc) from exc
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        self._count("all_reduce", t0)
        return total.to(x.dtype)

    def all_reduce_gloo(self, x: torch.Tensor) -> torch.Tensor:
        """`all_reduce` by gloo's ring algorithm (the reference; any number of ranks)."""
        t0 = time.perf_counter()
        y = x.float().contiguous() if x.dtype != torch.float32 else x.clone()
        try:
            dist.all_reduce(y)
        except (RuntimeError, dist.DistError) as exc:
            raise self._fail("all-reduce", exc) from exc
        self._count("all_reduce", t0)
        return y.to(x.dtype)

    def all_gather_columns(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """Every rank's ``x [T, widths[rank]]`` side by side: ``[T, sum(widths)]``, in rank order
        (uneven widths are padded for the transfer and cut after)."""
        t0 = time.perf_counter()
        part = torch.zeros(x.shape[0], max(widths), dtype=x.dtype)
        part[:, : x.shape[1]] = x
        try:
            if self.size <= EXCHANGE_MAX_RANKS:
                parts = self.exchange(part)
            else:
                parts = [torch.empty_like(part) for _ in range(self.size)]
                dist.all_gather(parts, part)
        except (RuntimeError, dist.DistError) as exc:
            raise self._fail("all-gather", exc) from exc
        out = torch.cat([p[:, :n] for p, n in zip(parts, widths)], dim=1)
        self._count("all_gather", t0)
        return out

    # -- the step broadcast (rank 0 -> followers) -------------------------------------------
    def send(self, call) -> None:
        """Rank 0: hand `call` (a picklable ``(method, args)``, or None: stop) to every follower.
        Raises `TensorParallelError` when a follower this process started has exited, or the
        broadcast fails."""
        t0 = time.perf_counter()
        self.check_followers()
        try:
            dist.broadcast_object_list([call], src=0, group=self.commands)
        except (RuntimeError, dist.DistError) as exc:
            raise self._fail("the step broadcast", exc) from exc
        self._count("broadcast", t0)

    def check_followers(self) -> None:
        """Raise `TensorParallelError` naming the first follower this process started that has
        exited (its status, or the signal that killed it)."""
        for rank, proc in self.followers.items():
            status = proc.poll()
            if status is not None:
                how = f"killed by signal {-status}" if status < 0 else f"status {status}"
                raise TensorParallelError(f"tensor parallel rank {self.rank}: rank {rank} exited ({how}) before the "
                                          f"step broadcast")

    def receive(self):
        """A follower: the next call rank 0 sent (waits without a deadline)."""
        box = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=self.commands)
        except (RuntimeError, dist.DistError) as exc:
            raise self._fail("waiting for rank 0", exc) from exc
        return box[0]

    def close(self) -> None:
        """Rank 0: tell the followers to stop (once); every rank: leave the group."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.rank == 0:
                self.send(None)
        except TensorParallelError:  # a follower already gone: nothing left to tell
            pass
        dist.destroy_process_group()
        for proc in self.followers.values():  # (told to stop, or gone: reaped, never left a zombie)
            try:
                proc.wait(timeout=FOLLOWER_EXIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.cores is not None:
            os.sched_setaffinity(0, self.cores)


# -- starting the ranks -----------------------------------------------------------------------
def torchrun_rank() -> int | None:
    """This process's rank when torchrun (or another launcher setting ``RANK`` and ``WORLD_SIZE``)
    started it, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"])
    return None


def is_follower() -> bool:
    """Whether this process is a torchrun rank other than 0 (it loads a shard and follows)."""
    rank = torchrun_rank()
    return rank is not None and rank != 0


def init_tensor_parallel(size: int, follower_argv: list[str] | None = None) -> TensorParallel | None:
    """The group for `size` ranks (None when `size` is 1). Under torchrun, joins it (the world
    size must be `size`); otherwise starts ranks 1..size-1 here, each as ``python -m
    nextoken.runner.follower --rank R --size N --port P *follower_argv`` (the engine's flags,
    `EngineArgs.to_cli_args`), and joins them as rank 0. Pins this rank to its slice of the
    cores. Raises `InvalidRequest` when torchrun started another number of processes."""
    if size == 1:
        return None
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    rank, cores = torchrun_rank(), os.sched_getaffinity(0)
    followers: dict[int, subprocess.Popen] = {}
    if rank is not None:
        world = int(os.environ["WORLD_SIZE"])
        if world != size:
            raise InvalidRequest(f"--tensor-parallel-size {size} but the launcher started {world} processes; "
                                 f"use torchrun --nproc-per-node {size} (times the nodes)", "tensor_parallel_size")
        local = int(os.environ.get("LOCAL_RANK", rank)), int(os.environ.get("LOCAL_WORLD_SIZE", world))
        pin_to_slice(*local)
        dist.init_process_group("gloo", timeout=timeout)
    else:
        port = _free_port()
        for r in range(1, size):
            followers[r] = subprocess.Popen([sys.executable, "-m", "nextoken.runner.follower", "--rank", str(r), "--size", str(size),
                              "--port", str(port), *(follower_argv or [])])
        pin_to_slice(0, size)
        try:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=size,
                                    timeout=timeout)
        except (RuntimeError, dist.DistError) as exc:  # a follower died before it joined (its error is above)
            for proc in followers.values():  # (the others would wait for the group until their own timeout)
                proc.kill()
                proc.wait()
            raise TensorParallelError(f"tensor parallel: ranks 1..{size - 1} did not join rank 0 within "
                                      f"{COLLECTIVE_TIMEOUT_S} s ({str(exc).splitlines()[0]})") from exc
        rank = 0
    tp = TensorParallel(rank, size, cores, followers)
    if rank == 0:
        atexit.register(tp.close)
    log.info("tensor parallel: rank %d of %d, cores %s", rank, size, sorted(os.sched_getaffinity(0)))
    return tp


def pin_to_slice(local_rank: int, local_size: int) -> None:
    """Pin this process to slice `local_rank` of `local_size` equal slices of its cores (no
    pinning when there are fewer cores than ranks: they share)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < local_size:
        log.warning("%d tensor-parallel ranks share %d cores", local_size, len(cores))
        return
    k = len(cores) // local_size
    os.sched_setaffinity(0, cores[local_rank * k:(local_rank + 1) * k])


def rank_threads(requested: int | None) -> int | None:
    """A rank's compute threads: `requested` (None: one per core of its slice), but no more than
    the cores it is pinned to (more would only make the threads of its cores spin against each
    other, which slows decoding by an order of magnitude)."""
    cores = len(os.sched_getaffinity(0))
    if requested is not None and requested > cores:
        log.warning("--threads %d is more than this rank's %d cores; using %d", requested, cores, cores)
        return cores
    return requested


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_as_follower(rank: int, size: int, port: int) -> TensorParallel:
    """In a rank started by rank 0: pin to its slice, join rank 0's group on `port`."""
    pin_to_slice(rank, size)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return TensorParallel(rank, size)
