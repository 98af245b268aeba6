"""A client's persistent state mirrored to disk, so it survives a new Flower run and a SuperNode restart.

Flower's ``context.state`` lives as long as one Flower run on one SuperNode process: after
``graphfl run --resume`` (a new run id) or a restarted SuperNode it is empty. With a state folder
(the SuperNode's node-config ``state-dir``, set by graphfl's launcher to ``<out>/client-state``)
every served message's resulting state is also written to::

    <state-dir>/<run-key>/client-<partition id>-r<round>.npz

Rules (DESIGN: exact resume, no step applied twice)
---------------------------------------------------
* the state is saved with the round of the message that produced it, atomically (temporary
  file + ``os.replace``); the newest :data:`KEEP` rounds are kept, older files removed;
* serving round ``t`` with no state of this Flower run in memory, the client loads the newest
  saved state of a round ``< t``. A client that crashed (or whose server crashed) after it had
  already advanced to round ``t`` thus restarts from round ``t - 1``'s state, as the server's
  checkpoint does, instead of applying round ``t``'s step twice;
* a join request (round 0, sent again after every restart) neither loads nor saves a state.

Arrays are stored with ``numpy.savez`` and read with ``allow_pickle=False``.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import numpy as np

from graphfl.common import wire
from graphfl.common.results import atomic_write_bytes
from graphfl.common.types import Arrays

logger = logging.getLogger(__name__)

CLIENT_STATE_DIR = "client-state"
"""Where a run's clients mirror their state, under its output folder (``graphfl run``'s SuperNodes,
the in-process engine and simulations)."""

KEEP = 2
"""Saved rounds kept per client (the newest and the one before, for a crash mid-round)."""

savez: Any = np.savez
"""``numpy.savez`` (its stub's ``allow_pickle`` keyword clashes with ``**arrays``; npz never pickles numeric arrays)."""

_NAME = re.compile(r"^client-(\d+)-r(\d+)\.npz$")


class StateStore:
    """The saved states of one client (``partition_id``) of one run (``run_key``) under ``root``."""

    def __init__(self, root: str | Path, run_key: str, partition_id: int) -> None:
        if not run_key:
            raise ValueError("a client state folder needs the run's run-key (empty)")
        self.dir = Path(root) / run_key
        self.partition_id = int(partition_id)

    def path(self, server_round: int) -> Path:
        """``<dir>/client-<pid>-r<round>.npz``."""
        return self.dir / f"client-{self.partition_id}-r{int(server_round):07d}.npz"

    def rounds(self) -> list[int]:
        """Rounds with a saved state, ascending."""
        if not self.dir.is_dir():
            return []
        out = []
        for p in self.dir.iterdir():
            m = _NAME.match(p.name)
            if m and int(m.group(1)) == self.partition_id:
                out.append(int(m.group(2)))
        return sorted(out)

    def save(self, server_round: int, state: Arrays) -> Path:
        """Write ``state`` as produced by round ``server_round`` (atomically); keep the newest :data:`KEEP`."""
        self.dir.mkdir(parents=True, exist_ok=True)
        target = self.path(server_round)
        atomic_write_bytes(target, lambda fh: savez(fh, **{k: np.asarray(v) for k, v in state.items()}))
        for r in self.rounds()[:-KEEP]:
            self.path(r).unlink(missing_ok=True)
        return target

    def load_before(self, server_round: int) -> tuple[int, Arrays] | None:
        """The newest saved state of a round ``< server_round`` and its round, or ``None``.

        Raises
        ------
        ValueError
            When that file cannot be read (names the path): a corrupt state is not silently
            replaced by a fresh one.
        """
        earlier = [r for r in self.rounds() if r < server_round]
        if not earlier:
            return None
        r = earlier[-1]
        path = self.path(r)
        try:
            with np.load(path, allow_pickle=False) as z:
                return r, {k: np.array(z[k]) for k in z.files}
        except (OSError, ValueError) as exc:
            raise ValueError(f"client state {path} cannot be read: {exc}") from None


def state_for_request(store: StateStore | None, kind: str, server_round: int, state: Arrays,
                      live: bool) -> tuple[Arrays, int | None]:
    """The state to serve a request with, and the round of the saved state it came from (``None``
    when none was loaded): ``state`` (this Flower run's, in memory) when ``live`` (a non-join
    message of this run produced it), else the newest saved one of a round ``< server_round``;
    join requests always use ``state`` as it is. The caller reports a loaded round to the server
    as ``wire.STATE_RESTORED``.
    """
    if store is None or live or kind == wire.JOIN:
        return state, None
    loaded = store.load_before(server_round)
    if loaded is None:
        return state, None
    logger.info("client %d: restored its state of round %d from %s (serving round %d)",
                store.partition_id, loaded[0], store.dir, server_round)
    return loaded[1], loaded[0]


def store_for(state_dir: str | None, run_key: str, partition_id: int) -> StateStore | None:
    """A :class:`StateStore` when both a state folder and a run key are set, else ``None`` (no persistence)."""
    if not state_dir:
        return None
    if not run_key:
        logger.warning("state-dir %s is set but the run has no run-key: client state is not persisted", state_dir)
        return None
    return StateStore(state_dir, run_key, partition_id)
