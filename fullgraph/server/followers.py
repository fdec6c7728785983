"""A tensor-parallel server's ranks: rank 0's engine process leads (``Followers`` wraps its engine),
ranks 1 .. N-1 follow (``follow``), every rank making the same engine calls and steps."""
from __future__ import annotations

import logging
import pickle

logger = logging.getLogger("fullgraph.server")

HEARTBEAT_S = 60.0   # an idle leader still messages its followers this often (gloo's wait times out at 30 min)


class Followers:
    """Rank 0's engine, as the ranks of a tensor-parallel group follow it: the engine calls that
    change its state (``add_request``, ``abort``) are logged, and before each step the log and
    whether a step follows go to every other rank over a gloo group of their own (object
    messages stay off NCCL), which make the same calls and the same step: the engine being
    deterministic, every rank then schedules the same batch and meets the step's collectives."""

    def __init__(self, engine) -> None:
        self._engine, self._calls, self._group = engine, [], _control_group()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def add_request(self, *args):
        self._calls.append(("add_request", args))
        return self._engine.add_request(*args)

    def abort(self, *args):
        self._calls.append(("abort", args))
        return self._engine.abort(*args)

    def send(self, stepping: bool | None) -> None:
        """This iteration's calls and whether a step follows (None: stop)."""
        _send(self._group, self._calls, stepping)
        self._calls = []


STOP, IDLE, STEP = -1, 0, 1


def _send(group, calls: list, stepping: bool | None) -> None:
    """One header broadcast (what follows; the calls' pickled size), and the calls only if any: a
    decode step with nothing new costs one small collective, not a pickled object's two."""
    import torch
    import torch.distributed as dist

    payload = pickle.dumps(calls) if calls else b""
    what = STOP if stepping is None else (STEP if stepping else IDLE)
    dist.broadcast(torch.tensor([what, len(payload)], dtype=torch.int64), src=0, group=group)
    if payload:
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=group)


def _receive(group) -> tuple[list, bool | None]:
    """What ``_send`` sent: (the calls, whether a step follows; None: stop)."""
    import torch
    import torch.distributed as dist

    header = torch.zeros(2, dtype=torch.int64)
    dist.broadcast(header, src=0, group=group)
    what, size = header.tolist()
    calls = []
    if size:
        payload = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=group)
        calls = pickle.loads(payload.numpy().tobytes())
    return calls, None if what == STOP else what == STEP


def _control_group():
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


def follow(config) -> int:
    """A rank > 0 of a tensor-parallel server: load its shard, then make rank 0's engine calls and
    steps as they come (``Followers``), until rank 0 stops. Its outputs are rank 0's; it keeps none."""
    from .config import load_llm

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    engine = load_llm(config).engine
    group = _control_group()
    while True:
        calls, stepping = _receive(group)
        if stepping is None:
            from ..parallel import close_tensor_parallel

            close_tensor_parallel()
            return 0
        for name, args in calls:
            try:
                getattr(engine, name)(*args)
            except Exception:  # noqa: BLE001 (rank 0's call failed the same way and it went on)
                pass
        if stepping:
            try:
                engine.step()
            except Exception:  # noqa: BLE001 (as on rank 0: the step's requests are aborted by the next calls)
                logger.exception("fullgraph: a following rank's engine step failed")
