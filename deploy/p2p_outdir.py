"""Output folders of p2p runs: who owns them, and what a new run may replace.

Ownership (:mod:`graphfl.common.run_lock`): ``graphfl p2p`` holds the folder's lock
(``.graphfl.lock``) for the whole run; each peer process holds its own lock in its ``--out``
(``.graphfl-peer-<id>.lock``), so the peers of one network share a folder but two processes of
one peer id never do. The OS drops a lock when its process dies (SIGKILL included), so a
killed peer can be restarted at once.

What a new run may replace:

* ``graphfl p2p --out DIR``: an empty or new folder. A folder holding files is refused unless
  ``--overwrite``, which removes only a p2p run's own files (:func:`is_p2p_file`) and refuses a
  folder holding anything else.
* ``graphfl peer --out DIR`` for peer ``i``: a folder whose ``peer-<i>.json`` says ``done`` holds a
  finished peer's results and is refused; ``--overwrite`` removes that peer's files (only
  those: ``peer-<i>.*``) and starts it anew. With ``--resume`` a finished peer continues only
  when ``rounds`` grows. A peer that did not finish (killed, stopped, failed) is restarted as
  before: from its checkpoint with ``--resume``, from its initial model without.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from graphfl.common import run_lock
from graphfl.common.config import ConfigError

logger = logging.getLogger(__name__)

_P2P_FILE = re.compile(r"p2p\.(json|md|png)|network\.toml|prepare\.json|certs|logs|peer-\d+\..+|\..+\.tmp")


def peer_lock_name(peer_id: int) -> str:
    """``.graphfl-peer-<id>.lock``: the lock a peer process holds in its output folder."""
    return f".graphfl-peer-{peer_id}.lock"


def is_p2p_file(name: str) -> bool:
    """Whether a name in a folder is one a p2p run writes (results, network file, certificates,
    logs, a peer's files, a lock file or a leftover temporary file).
    """
    return bool(_P2P_FILE.fullmatch(name)) or name in run_lock.LOCK_FILES or name.startswith(".graphfl-peer-")


def _is_lock(name: str) -> bool:
    return name in run_lock.LOCK_FILES or (name.startswith(".graphfl-peer-") and name.endswith(".lock"))


def claim_network_folder(out: Path, overwrite: bool = False) -> run_lock.FolderLock:
    """Take ``out`` for a ``graphfl p2p`` run (see the module docstring); the caller releases the lock.

    Raises
    ------
    ConfigError
        ``out`` is a file, cannot be created, holds files (without ``overwrite``), holds files a
        p2p run does not write (even with ``overwrite``), or another process owns it.
    """
    return run_lock.claim_output_folder(out, overwrite=overwrite, kind="p2p run", own_file=is_p2p_file,
                                        ignore=_is_lock, role="p2p launcher")


def _peer_files(out: Path, peer_id: int) -> list[Path]:
    return sorted(p for p in out.glob(f"peer-{peer_id}.*") if p.is_file())


def _finished(doc: Any) -> int | None:
    """The rounds of a finished peer's result document (``outcome == "done"``), else ``None``."""
    if not isinstance(doc, dict) or doc.get("outcome") != "done":
        return None
    try:
        return int(doc["config"]["run"]["rounds"])
    except (KeyError, TypeError, ValueError):
        return 0


def claim_peer_folder(out: Path, peer_id: int, *, resume: bool = False, overwrite: bool = False,
                      rounds: int | None = None) -> run_lock.FolderLock:
    """Take peer ``peer_id``'s place in ``out`` (see the module docstring); the caller releases the lock.

    ``rounds`` is the number of rounds this start will run (``None``: unknown, not checked).

    Raises
    ------
    ConfigError
        Another process of this peer id owns the folder, the folder holds this peer's finished
        results (without ``overwrite``; with ``resume``, unless ``rounds`` grows), or both
        ``resume`` and ``overwrite`` were given.
    """
    if resume and overwrite:
        raise ConfigError("give --resume (continue this peer's run) or --overwrite (replace it), not both")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot create the folder ({exc.strerror or exc})") from None
    lock = run_lock.acquire(out, name=peer_lock_name(peer_id), role=f"peer {peer_id}")
    try:
        result = out / f"peer-{peer_id}.json"
        try:
            doc = json.loads(result.read_text())
        except (OSError, ValueError):
            doc = None
        done = _finished(doc)
        if overwrite:
            old = _peer_files(out, peer_id)
            for path in old:
                path.unlink()
            if old:
                logger.warning("--overwrite: removed peer %d's previous files from %s", peer_id, out)
        elif done is not None and not resume:
            raise ConfigError(f"--out {out}: {result.name} holds the finished results of peer {peer_id} "
                              f"({done} rounds, outcome done); a new run would replace them: pass --overwrite to "
                              "replace this peer's files, --resume --set rounds=N to continue it, or another --out")
        elif done is not None and rounds is not None and rounds <= done:
            raise ConfigError(f"--out {out}: peer {peer_id} already finished its {done} rounds ({result.name}); "
                              f"give --set rounds=N (N > {done}) to continue it, or --overwrite to start again")
        elif not resume and (out / f"peer-{peer_id}.ckpt.json").is_file():
            logger.warning("peer %d: %s holds its checkpoint; starting from the initial model (--resume continues "
                           "from the checkpoint)", peer_id, out)
    except BaseException:
        lock.release()
        raise
    return lock
