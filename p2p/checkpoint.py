"""Per-node checkpoints: everything in a :class:`NodeState` plus the RNG states, npz + json, no pickle.

Files (in the peer's output folder)::

    peer-<id>.ckpt.json            # what and where: t, round, algorithm, params, RNG states,
                                   # the array keys and the sha256 of the npz it belongs to
    peer-<id>.ckpt-r<round>.npz    # the arrays: theta, tracker, aux.<name>, edge.<j>.<name>

A checkpoint is written atomically: the npz of the new round is written under a temporary name
and renamed, then the json (the commit point) is replaced the same way, then older npz files are
removed. A crash at any moment leaves the previous checkpoint intact, and :func:`load` verifies
the pair (format, node, sha256) before restoring. Arrays are loaded with ``allow_pickle=False``.

What is checkpointed: ``t``, ``θ_i``, the tracker, every ``aux`` array, the per-edge state of every
neighbour, the last loss, the algorithm's RNG (``NodeState.rng``) and the local problem's
minibatch RNG (the oracle's ``rng`` attribute, a :class:`numpy.random.Generator`), so that a
restored node continues exactly as if it had not stopped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from graphfl.common.config import ConfigError
from graphfl.common.results import atomic_write_bytes, atomic_write_text
from graphfl.p2p.algorithms.base import Array, NodeState

logger = logging.getLogger(__name__)

FORMAT = 1
_THETA, _TRACKER, _AUX, _EDGE = "theta", "tracker", "aux.", "edge."
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


class CheckpointError(ConfigError):
    """A checkpoint is missing, inconsistent, or belongs to another node / algorithm / config."""


savez: Any = np.savez
"""``numpy.savez`` (its stub's ``allow_pickle`` keyword clashes with ``**arrays``; npz never pickles numeric arrays)."""


def params_dict(params: Any) -> dict[str, Any]:
    """An algorithm's params dataclass as a JSON-ready dict."""
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        return dataclasses.asdict(params)
    return dict(params)


def json_path(directory: str | Path, node: int) -> Path:
    """``<directory>/peer-<node>.ckpt.json``."""
    return Path(directory) / f"peer-{node}.ckpt.json"


def _npz_name(node: int, round_: int) -> str:
    return f"peer-{node}.ckpt-r{round_:07d}.npz"


def oracle_rng(oracle: Any) -> np.random.Generator | None:
    """The local problem's minibatch RNG (its ``rng`` attribute), if it has one."""
    rng = getattr(oracle, "rng", None)
    return rng if isinstance(rng, np.random.Generator) else None


def _to_json(value: Any) -> Any:
    """RNG states hold Python ints (exact in JSON) and, for some bit generators, numpy arrays."""
    if isinstance(value, np.ndarray):
        return {"__ndarray__": value.tolist(), "dtype": value.dtype.str}
    if isinstance(value, Mapping):
        return {str(k): _to_json(v) for k, v in value.items()}
    if isinstance(value, (np.integer,)):
        return int(value)
    return value


def _from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if "__ndarray__" in value:
            return np.asarray(value["__ndarray__"], dtype=np.dtype(value["dtype"]))
        return {k: _from_json(v) for k, v in value.items()}
    return value


def _generator(saved: Any, where: Path) -> np.random.Generator:
    """A :class:`numpy.random.Generator` in the saved state (its bit generator named in the state)."""
    state = _from_json(saved)
    kind = getattr(np.random, str(state.get("bit_generator", "")), None)
    if kind is None:
        raise CheckpointError(f"{where}: unknown bit generator {state.get('bit_generator')!r} in the RNG state")
    gen = np.random.Generator(kind())
    gen.bit_generator.state = state
    return gen


def _rng_state(rng: np.random.Generator | None) -> Any:
    return None if rng is None else _to_json(rng.bit_generator.state)


def _arrays(state: NodeState) -> dict[str, Array]:
    out: dict[str, Array] = {_THETA: np.asarray(state.theta)}
    if state.tracker is not None:
        out[_TRACKER] = np.asarray(state.tracker)
    for name, a in state.aux.items():
        out[f"{_AUX}{name}"] = np.asarray(a)
    for j, edge in state.edges.items():
        for name, a in edge.items():
            out[f"{_EDGE}{int(j)}.{name}"] = np.asarray(a)
    for key, a in out.items():
        if a.dtype.hasobject:
            raise CheckpointError(f"checkpoint array {key!r} has dtype object; only numeric arrays are saved")
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save(
    directory: str | Path,
    node: int,
    state: NodeState,
    *,
    algorithm: str,
    params: Any,
    round_: int,
    oracle: Any = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write node ``node``'s checkpoint after round ``round_``; returns the json path.

    Parameters
    ----------
    params
        The algorithm's params dataclass (stored, and compared by :func:`load`).
    oracle
        The local problem; its minibatch RNG state is stored when it has one.
    extra
        More JSON-ready metadata (e.g. the config hash).
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    arrays = _arrays(state)
    npz = d / _npz_name(node, round_)
    atomic_write_bytes(npz, lambda fh: savez(fh, **arrays))
    meta = {
        "format": FORMAT,
        "node": node,
        "algorithm": algorithm,
        "params": params_dict(params),
        "t": int(state.t),
        "round": int(round_),
        "loss": None if not math.isfinite(state.loss) else float(state.loss),
        "npz": npz.name,
        "sha256": _sha256(npz),
        "arrays": sorted(arrays),
        "edges": sorted(int(j) for j in state.edges),
        "rng": {"oracle": _rng_state(oracle_rng(oracle)), "state": _rng_state(state.rng)},
        "extra": dict(extra or {}),
    }
    path = json_path(d, node)
    atomic_write_text(path, json.dumps(meta, indent=1))
    for old in d.glob(f"peer-{node}.ckpt-r*.npz"):
        if old.name != npz.name:
            old.unlink(missing_ok=True)
    return path


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: the node state and what it was written with."""

    node: int
    round: int
    algorithm: str
    params: dict[str, Any]
    state: NodeState
    oracle_rng_state: Any
    extra: dict[str, Any]

    def restore_oracle_rng(self, oracle: Any) -> None:
        """Put the saved minibatch RNG state back into ``oracle`` (which must have the same kind of RNG)."""
        rng = oracle_rng(oracle)
        if (rng is None) != (self.oracle_rng_state is None):
            raise CheckpointError(f"peer {self.node}: checkpoint has {'no ' if self.oracle_rng_state is None else ''}"
                                  f"minibatch RNG state, the local problem has {'none' if rng is None else 'one'}")
        if rng is not None:
            rng.bit_generator.state = _from_json(self.oracle_rng_state)

    def check(self, algorithm: str, params: Any) -> None:
        """Raise :class:`CheckpointError` unless written by ``algorithm`` with ``params``."""
        if algorithm != self.algorithm:
            raise CheckpointError(f"peer {self.node}: checkpoint is of algorithm {self.algorithm!r}, "
                                  f"this run is {algorithm!r}")
        mine = params_dict(params)
        if mine != self.params:
            diff = sorted(k for k in set(mine) | set(self.params) if mine.get(k) != self.params.get(k))
            raise CheckpointError(f"peer {self.node}: checkpoint was written with other {algorithm} settings "
                                  f"({', '.join(f'{k}: {self.params.get(k)!r} != {mine.get(k)!r}' for k in diff)})")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_meta(meta: dict[str, Any], path: Path) -> None:
    """Validate every field of a peer checkpoint's json (types and ranges) before anything uses it.

    ``t`` and ``round`` integers >= 0, ``algorithm`` a string, ``params`` / ``extra`` tables,
    ``loss`` a finite number or null, ``npz`` exactly ``peer-<node>.ckpt-r<round, 7 digits>.npz``
    (a name in the same folder), ``sha256`` 64 hex digits, ``arrays`` a list of names,
    ``edges`` a list of peer ids (integers >= 0), ``rng`` a table with ``oracle`` and ``state``
    (each a table or null).

    Raises
    ------
    CheckpointError
        Naming the file, the key and the bad value.
    """
    def bad(key: str, expected: str) -> CheckpointError:
        return CheckpointError(f"{path}: key {key!r} is {meta.get(key)!r}; expected {expected} "
                               f"(a damaged or hand-edited checkpoint)")

    for key in ("algorithm", "params", "t", "round", "loss", "npz", "sha256", "arrays", "edges", "rng"):
        if key not in meta:
            raise CheckpointError(f"{path}: key {key!r} is missing (a damaged or hand-edited checkpoint)")
    for key in ("t", "round"):
        if not _is_int(meta[key]) or meta[key] < 0:
            raise bad(key, "an integer >= 0")
    if not isinstance(meta["algorithm"], str):
        raise bad("algorithm", "a string")
    for key in ("params", "extra"):
        if not isinstance(meta.get(key, {}), dict):
            raise bad(key, "a table")
    loss = meta["loss"]
    if loss is not None and (isinstance(loss, bool) or not isinstance(loss, (int, float)) or not math.isfinite(loss)):
        raise bad("loss", "a finite number or null")
    if meta["npz"] != _npz_name(meta["node"], meta["round"]):
        raise bad("npz", f"{_npz_name(meta['node'], meta['round'])!r} (the array file of its round)")
    if not isinstance(meta["sha256"], str) or not _SHA256_RE.fullmatch(meta["sha256"]):
        raise bad("sha256", "64 hexadecimal digits")
    if not isinstance(meta["arrays"], list) or not all(isinstance(a, str) for a in meta["arrays"]):
        raise bad("arrays", "a list of array names")
    if not isinstance(meta["edges"], list) or not all(_is_int(j) and j >= 0 for j in meta["edges"]):
        raise bad("edges", "a list of peer ids (integers >= 0)")
    rng = meta["rng"]
    if (not isinstance(rng, dict) or set(rng) != {"oracle", "state"}
            or not all(v is None or isinstance(v, dict) for v in rng.values())):
        raise bad("rng", "a table with 'oracle' and 'state' (each an RNG state table or null)")


def load(directory: str | Path, node: int) -> Checkpoint:
    """Read node ``node``'s checkpoint from ``directory`` (verifying the npz against the json).

    Raises
    ------
    CheckpointError
        If the files are missing, of another format or node, or do not match each other.
    """
    path = json_path(directory, node)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint for peer {node}: {path} not found")
    try:
        meta = json.loads(path.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(f"{path}: checkpoint format {got!r}, this graphfl reads {FORMAT}")
    if meta.get("node") != node or not _is_int(meta.get("node")):
        raise CheckpointError(f"{path}: checkpoint of peer {meta.get('node')!r}, not of peer {node}")
    check_meta(meta, path)
    npz = path.parent / str(meta["npz"])
    if not npz.is_file():
        raise CheckpointError(f"{path}: its array file {npz.name} is missing")
    if _sha256(npz) != meta["sha256"]:
        raise CheckpointError(f"{path}: {npz.name} does not match the checksum in the json (partial write?)")
    with np.load(npz, allow_pickle=False) as z:
        arrays = {k: np.array(z[k]) for k in z.files}
    if sorted(arrays) != meta["arrays"]:
        raise CheckpointError(f"{path}: {npz.name} holds {sorted(arrays)}, the json lists {meta['arrays']}")
    aux = {k[len(_AUX):]: a for k, a in arrays.items() if k.startswith(_AUX)}
    edges: dict[int, dict[str, Array]] = {int(j): {} for j in meta["edges"]}
    for k, a in arrays.items():
        if k.startswith(_EDGE):
            j, _, name = k[len(_EDGE):].partition(".")
            edges.setdefault(int(j), {})[name] = a
    try:
        rng = None if meta["rng"]["state"] is None else _generator(meta["rng"]["state"], path)
        if meta["rng"]["oracle"] is not None:
            _generator(meta["rng"]["oracle"], path)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise CheckpointError(f"{path}: key 'rng' holds an RNG state numpy refuses ({type(exc).__name__}: {exc}) "
                              f"(a damaged or hand-edited checkpoint)") from None
    state = NodeState(t=int(meta["t"]), theta=arrays[_THETA], tracker=arrays.get(_TRACKER), aux=aux,
                      edges=dict(sorted(edges.items())), loss=float("nan") if meta["loss"] is None else float(meta["loss"]),
                      rng=rng)
    return Checkpoint(node=node, round=int(meta["round"]), algorithm=str(meta["algorithm"]), params=dict(meta["params"]),
                      state=state, oracle_rng_state=meta["rng"]["oracle"], extra=dict(meta.get("extra", {})))
