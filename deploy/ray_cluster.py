"""The Ray cluster a simulation run uses: its own local Ray, or an existing cluster it joins.

Flower's simulation engine is Ray: the simulation SuperLink's ``flwr-simulation`` process calls
``ray.init`` with the run's backend init arguments. Flower's federation config carries only four
of them (``num-cpus``, ``num-gpus``, ``logging-level``, ``log-to-driver``; Flower 1.41 and 1.42),
not an address, so the address goes through Ray's own public setting instead: the environment
variable ``RAY_ADDRESS``, which ``ray.init()`` reads when it is given no address. The SuperLink
process and the ``flwr-simulation`` process it starts inherit it (:func:`superlink_env`).

Rules
-----
* without ``--ray-address`` the SuperLink gets ``RAY_ADDRESS=local``: Flower starts its own
  local Ray for the run, even where a ``ray start`` cluster runs on this machine or the caller's
  environment names one (``ray.init()`` would join either silently);
* with ``--ray-address HOST:PORT`` (or ``$GRAPHFL_RAY_ADDRESS``, which the benchmarks'
  simulation runs read) the address is checked before anything starts (:func:`probe`): a TCP
  connection within ``connect_timeout``, then a Ray driver in a child process that joins the
  cluster and reads its alive nodes and resources within ``timeout`` (killed after it). A bad,
  unreachable or non-Ray address is a :class:`~graphfl.common.errors.ConfigError` naming the
  option, never a hang;
* the run's ``run.json`` then records the cluster under ``ray_cluster`` (:func:`record`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from graphfl.common.errors import ConfigError
from graphfl.common.ports import port_open

logger = logging.getLogger(__name__)

OPTION = "--ray-address"
ENV_VAR = "GRAPHFL_RAY_ADDRESS"
"""Read when ``--ray-address`` is not given (``graphfl bench ...`` simulation runs)."""
RAY_ADDRESS = "RAY_ADDRESS"
"""Ray's own environment variable: the address ``ray.init()`` uses when given none."""
LOCAL = "local"
"""``RAY_ADDRESS=local``: ``ray.init()`` starts a new local Ray even where another one runs."""

_PROBE = """
import json, sys
import ray
ray.init(address=sys.argv[1], include_dashboard=False, logging_level="ERROR", log_to_driver=False)
nodes = [n for n in ray.nodes() if n.get("Alive")]
res = ray.cluster_resources()
print("GRAPHFL-RAY " + json.dumps({"nodes": len(nodes), "cpus": float(res.get("CPU", 0)),
                                  "gpus": float(res.get("GPU", 0)), "ray": ray.__version__}))
ray.shutdown()
"""


@dataclass(frozen=True)
class RayCluster:
    """An existing Ray cluster as :func:`probe` found it: address, alive nodes, total CPUs and GPUs,
    and the Ray version of the driver that joined it (the cluster refuses another).
    """

    address: str
    nodes: int
    cpus: float
    gpus: float
    ray: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def resolve_address(address: str | None) -> str | None:
    """The address to join: ``address``, else ``$GRAPHFL_RAY_ADDRESS``; ``None`` (or empty) for a local Ray."""
    if address is None:
        address = os.environ.get(ENV_VAR)
    address = (address or "").strip()
    return address or None


def split_address(address: str, option: str = OPTION) -> tuple[str, int]:
    """``(host, port)`` of a Ray head's ``HOST:PORT`` (the GCS address ``ray start --head`` prints).

    Raises
    ------
    ConfigError
        Naming ``option``: not ``HOST:PORT`` with a port in 1..65535, or a Ray Client
        ``ray://`` address (Flower's simulation needs a driver inside the cluster).
    """
    if "://" in address:
        raise ConfigError(f"{option} {address!r}: give the cluster's HOST:PORT (the address `ray start --head` "
                          "prints, port 6379 by default), not a Ray Client URL")
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{option} {address!r}: expected HOST:PORT of a Ray head (e.g. 10.0.0.5:6379)")
    return host, int(port)


def probe(address: str, connect_timeout: float = 5.0, timeout: float = 60.0, option: str = OPTION) -> RayCluster:
    """Join the Ray cluster at ``address`` from a child process and describe it; bounded in time.

    Raises
    ------
    ConfigError
        Naming ``option``: a malformed address, no TCP connection within ``connect_timeout``,
        no Ray answer within ``timeout`` (the child is killed), or Ray's own refusal (another Ray
        or Python version, not a Ray head) with its last error line.
    """
    host, port = split_address(address, option)
    if not port_open(host, port, timeout=connect_timeout):
        raise ConfigError(f"{option} {address}: nothing answers there (no TCP connection within "
                          f"{connect_timeout:.0f} s); start the head with `ray start --head --port {port}`")
    env = {k: v for k, v in os.environ.items() if k != RAY_ADDRESS}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    proc = subprocess.Popen([sys.executable, "-c", _PROBE, address], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise ConfigError(f"{option} {address}: no Ray cluster answered within {timeout:.0f} s "
                          "(is it a Ray head's GCS port?)") from None
    for line in out.splitlines():
        if line.startswith("GRAPHFL-RAY "):
            doc = json.loads(line.split(" ", 1)[1])
            cluster = RayCluster(address=address, nodes=int(doc["nodes"]), cpus=float(doc["cpus"]),
                                 gpus=float(doc["gpus"]), ray=str(doc["ray"]))
            logger.info("joining the Ray cluster at %s: %d nodes, %g CPUs, %g GPUs", address, cluster.nodes,
                        cluster.cpus, cluster.gpus)
            return cluster
    raise ConfigError(f"{option} {address}: Ray could not join it: {_last_error(err)}")


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:   # a process outside the group kept the pipes open
        pass


def _last_error(stderr: str) -> str:
    """The last line of ``stderr`` that names an error (else its last line)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line[-500:]
    return lines[-1][-500:] if lines else "no output"


def superlink_env(cluster: RayCluster | None) -> dict[str, str]:
    """Environment of a simulation SuperLink: ``RAY_ADDRESS`` = the cluster's address, or ``local``."""
    return {RAY_ADDRESS: cluster.address if cluster is not None else LOCAL}


def record(out: Path, cluster: RayCluster) -> None:
    """Add ``ray_cluster`` (:meth:`RayCluster.to_json`) to ``out/run.json``; a missing or unreadable
    ``run.json`` is left alone (the launcher's failure report then says what happened).
    """
    from graphfl.common.results import write_json

    path = out / "run.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        logger.warning("%s: no readable run.json to record the Ray cluster %s in", out, cluster.address)
        return
    if not isinstance(doc, dict):
        return
    doc["ray_cluster"] = cluster.to_json()
    try:
        write_json(path, doc)
    except OSError as exc:
        logger.error("could not record the Ray cluster in %s: %s", path, exc)
