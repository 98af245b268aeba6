"""One peer process: ``graphfl peer --topology net.toml --id I [--out DIR]``.

Reads the network file, builds the node's oracle (its data partition and model) and the
algorithm, listens, handshakes with its neighbours (bounded by ``connect-timeout``), runs
:func:`graphfl.p2p.driver.run_node` over gRPC, and writes

* ``<out>/peer-<id>.json`` — config, per-round records (loss, test loss, local disagreement,
  compute/communication seconds, bytes sent/received, skipped neighbours), the outcome, and
  ``links``: ``{neighbour: {"bytes_sent", "bytes_received"}}``, the wire bytes of the accepted
  messages over each link (also in the status file while running);
* ``<out>/peer-<id>.npz`` — the algorithm's output arrays: the final ``theta`` (and ``tracker`` for
  DFL-GT, ``estimate`` = ``θ̄_i`` for FedADMM);
* ``report`` in ``peer-<id>.json`` — the algorithm's results beyond the records (FedADMM: estimate,
  test metrics, selected edges; FedRelax: test metrics);
* ``<out>/peer-<id>.ckpt.json`` + ``peer-<id>.ckpt-r<round>.npz`` — the checkpoint, rewritten
  every ``checkpoint-every`` rounds (:mod:`graphfl.p2p.checkpoint`); ``resume=True``
  (``graphfl peer --resume``) continues from it;
* ``<out>/peer-<id>.status.json`` — progress, rewritten at most every :data:`STATUS_EVERY_S` s and
  after the last round (the launcher reads it).

Exit codes: 0 done, 1 internal error (traceback in the log and in ``peer-<id>.json``),
2 configuration error, 3 refused handshake / TLS, 4 round failed (``on-missing = "fail"``),
5 unreachable neighbours under ``on-missing = "fail"``, or no message from any neighbour in any
round (outcome ``isolated``), 6 a port cannot be bound (outcome ``bind-failed``), 7 a result file
cannot be written (outcome ``write-failed``: a full disk, a quota, a file-size limit, a read-only
file system; see :func:`write_failed`), 130 stopped.
In a peer process gRPC core logs at ``GRPC_VERBOSITY=ERROR`` unless the environment says
otherwise (:mod:`graphfl.p2p.grpc_env`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from graphfl.common.config import ConfigError, device_problem
from graphfl.common.envinfo import peak_rss_mb
from graphfl.common.finite import final_losses, node_divergence
from graphfl.common.malloc import keep_freed_memory
from graphfl.common.results import ResultsWriteError, atomic_write_bytes, how_to_fix, write_json
from graphfl.common.results import clean_json as _clean
from graphfl.p2p import checkpoint, grpc_env  # grpc_env before any module that imports grpc: gRPC core's log level
from graphfl.p2p.algorithms.base import NodeContext, NodeState
from graphfl.p2p.config import NetworkFile, load_network_file
from graphfl.p2p.driver import run_node
from graphfl.p2p.exchange import FailurePolicy, NeighbourExchange, RoundFailed
from graphfl.p2p.grpc_transport import GrpcTransport, Identity, ListenError
from graphfl.p2p.oracles import BUILTIN_PROBLEMS, ProblemSpec, feature_columns, make_oracle
from graphfl.p2p.transport import HandshakeRefused, TransportError
from graphfl.tasks.base import DataError

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_ERROR, EXIT_CONFIG, EXIT_REFUSED, EXIT_ROUND_FAILED, EXIT_UNREACHABLE, EXIT_STOPPED = 0, 1, 2, 3, 4, 5, 130
EXIT_BIND = 6
EXIT_WRITE = 7


STATUS_EVERY_S = 0.25
"""Shortest interval between two rewrites of ``peer-<id>.status.json`` while running (the last
round is always written). Rewriting it every round cost ~5 ms of a 40 ms round (100k-parameter
ring, ``GRAPHFL_PROFILE``); every round still goes to ``peer-<id>.rounds.jsonl`` at once."""


def _write_json(path: Path, obj: Any) -> None:
    """Atomic, strict JSON (NaN/Inf become ``null``: ``Infinity`` is not JSON)."""
    write_json(path, obj)


def append_line(path: Path, line: str) -> None:
    """Append ``line`` and a newline to ``path``; a failed write leaves the file as it was.

    Raises
    ------
    ResultsWriteError
        The write failed (a full disk, a file-size limit, ...); the bytes of ``line`` that did get
        written are cut off again, so the file never ends in half a line.
    """
    data = memoryview((line + "\n").encode())
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ResultsWriteError(path, exc) from exc
    try:
        start = os.fstat(fd).st_size
        try:
            while data:
                data = data[os.write(fd, data):]
        except OSError:
            os.ftruncate(fd, start)
            raise
    except OSError as exc:
        raise ResultsWriteError(path, exc) from exc
    finally:
        os.close(fd)


def resume_hint(network_file: str | Path, peer_id: int, out: Path) -> str:
    """``"nothing written before is lost: `graphfl peer ... --resume` continues from the checkpoint of round
    R"``, or ``""`` when ``out`` holds no readable checkpoint of peer ``peer_id``.
    """
    try:
        at = int(json.loads(checkpoint.json_path(out, peer_id).read_text())["round"])
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return (f"nothing written before is lost: `graphfl peer --topology {network_file} --id {peer_id} --out {out} "
            f"--resume` continues from the checkpoint of round {at}")


def write_failed(exc: ResultsWriteError, network_file: str | Path, peer_id: int, out: Path) -> str:
    """The one-line error of a peer stopped by a failed write: the file and the errno (the
    :class:`~graphfl.common.results.ResultsWriteError`), what to do about it, and, when the peer
    has a checkpoint, that ``graphfl peer --resume`` continues from it (the Flower side's wording,
    :func:`graphfl.server.recorder.write_failure`).
    """
    return "; ".join(p for p in (str(exc), how_to_fix(exc, out), resume_hint(network_file, peer_id, out)) if p)


def _finish(out: Path, peer_id: int, result: dict[str, Any], status_file: Path,
            network_file: str | Path, code: int) -> int:
    """Write ``peer-<id>.json`` and the final status; returns the exit code.

    When ``peer-<id>.json`` cannot be written, the peer ends ``write-failed`` (exit
    :data:`EXIT_WRITE`) with one error line (:func:`write_failed`), and what still fits is written:
    a compact ``peer-<id>.json`` without the records (they are in ``peer-<id>.rounds.jsonl``),
    holding ``run_outcome`` / ``run_error`` (how the run itself ended), then the status file.
    Nothing already written is touched: a failed atomic write leaves the previous file. A status
    file that cannot be written after a complete ``peer-<id>.json`` is logged as an error only
    (the exit code follows the result file, which holds the whole result).
    """
    path = out / f"peer-{peer_id}.json"
    try:
        _write_json(path, result)
    except ResultsWriteError as exc:
        reason = write_failed(exc, network_file, peer_id, out)
        logger.error("peer %d: %s", peer_id, reason)
        kept: tuple[str, ...] = ("peer", "config", "resumed_from", "start_t", "final_t", "seconds")
        compact: dict[str, Any] = {k: result[k] for k in kept if k in result}
        compact.update({"outcome": "write-failed", "error": reason, "run_outcome": result.get("outcome"),
                        "run_error": result.get("error"), "rounds_completed": len(result["records"]),
                        "records_file": f"peer-{peer_id}.rounds.jsonl"})
        result = compact
        code = EXIT_WRITE
        try:
            _write_json(path, compact)
        except ResultsWriteError as again:
            logger.debug("peer %d: compact %s not written either: %s", peer_id, path.name, again)
    try:
        _write_json(status_file, {"peer": peer_id, "state": result["outcome"],
                                  "round": result.get("rounds_completed", len(result.get("records", ()))),
                                  "error": result.get("error")})
    except ResultsWriteError as exc:
        if code != EXIT_WRITE:
            logger.error("peer %d: %s", peer_id, write_failed(exc, network_file, peer_id, out))
    return code


def never_heard(records: list[dict[str, Any]], neighbours: list[int]) -> str:
    """Why a run must not count as done: every round ran without any neighbour ("" otherwise).

    A peer with neighbours whose every round recorded all of them as missing trained alone the
    whole run (unreachable, refused, or locked out): its result is not a decentralized one.
    """
    if not records or not neighbours:
        return ""
    want = set(neighbours)
    if any(not want <= set(r.get("missing", ())) for r in records):
        return ""
    return (f"no message from any neighbour {sorted(want)} arrived in any of its {len(records)} round(s): "
            "the peer trained alone (see the warnings of its log for why its neighbours were missing)")


def problem_spec(net: NetworkFile, peer_id: int, device: str | None = None) -> ProblemSpec:
    """The local problem of peer ``peer_id`` as the network file's ``[run]`` table describes it.

    ``data-dir`` is relative to the network file; the peer's own ``data`` (``[[peers]]``) wins.
    ``device`` (``graphfl peer --device``) overrides the peer's ``device`` of the network file.
    """
    run = net.run
    me = net.topology.peer(peer_id)
    data_dir = run.data_dir
    if data_dir and not Path(data_dir).is_absolute():
        data_dir = str(net.path.parent / data_dir)
    return ProblemSpec(
        problem=run.problem, num_nodes=net.topology.n, seed=run.seed, batch_size=run.batch_size, dim=run.dim,
        samples=run.samples, standardize=run.standardize, input_scale=run.input_scale, device=device or me.device,
        data_dir=data_dir, data_path=me.data, features=run.features, shared_samples=run.shared_samples,
    )


def run_peer(network_file: str | Path, peer_id: int, out_dir: str | Path, overrides: dict[str, Any] | None = None,
             insecure: bool = False, stop: threading.Event | None = None, resume: bool = False,
             device: str | None = None, listen: str | None = None, malloc: str = "default") -> int:
    """Run one peer to completion; returns the exit code (see the module docstring).

    With ``resume`` the peer starts from its checkpoint in ``out_dir`` (same algorithm and
    parameters required; ``rounds`` may be larger) instead of the initial model. ``listen``
    (``HOST:PORT``) is where the peer binds when that differs from its address in the network
    file, which its neighbours dial (port forwarding, NAT, a link emulator in between).
    ``malloc`` is what :func:`graphfl.common.malloc.keep_freed_memory` returned in this process
    (recorded in ``peer-<id>.json``).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    status_file = out / f"peer-{peer_id}.status.json"
    rounds_file = out / f"peer-{peer_id}.rounds.jsonl"
    if not resume:
        rounds_file.unlink(missing_ok=True)
    result: dict[str, Any] = {"peer": peer_id, "outcome": "starting", "records": [], "malloc": malloc,
                              "grpc_verbosity": grpc_env.effective}
    stop = stop or threading.Event()
    transport = None
    code = EXIT_OK
    t_begin = time.monotonic()
    try:
        if listen is not None:
            host, sep, port = listen.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ConfigError(f"--listen must be HOST:PORT, got {listen!r}")
        net = load_network_file(network_file, overrides)
        if insecure:
            net = NetworkFile(net.path, net.topology, net.run, type(net.tls)(insecure=True))
        if net.tls.insecure:
            logger.warning(
                "peer %d runs in PLAINTEXT: any host that can reach %s can claim to be any neighbour, read "
                "and forge model updates. Use it only on a trusted, isolated network (see docs/p2p.md, TLS).",
                peer_id, net.topology.peer(peer_id).address)
        run = net.run
        topo = net.topology
        me = topo.peer(peer_id)
        result["config"] = {"run": dataclasses.asdict(net.run), "network": topo.name, "topology_version": topo.fingerprint,
                            "address": me.address, "partition": me.partition, "tls": not net.tls.insecure}
        if run.problem not in BUILTIN_PROBLEMS:  # a torch task: one thread per peer unless told otherwise
            import torch  # only a torch task's peer loads torch

            torch.set_num_threads(int(os.environ.get("GRAPHFL_TORCH_THREADS", "1")))
        algo = run.make_algorithm()
        algo.check_graph([(i, j) for i, j, _ in topo.edges], topo.n)
        if device is not None and device_problem(device):
            raise ConfigError(f"--device {device!r} is not valid; {device_problem(device)}")
        spec = problem_spec(net, peer_id, device)
        if spec.problem == "csv" and not spec.features:
            here = feature_columns(spec.data_path or spec.data_dir, me.partition)
            raise ConfigError(f"{net.path}: problem 'csv' needs [run] features, the feature columns in the order every "
                              f"device uses (e.g. features = {','.join(here)!r}, this device's columns in file order)")
        oracle = make_oracle(peer_id, spec, partition=me.partition)
        result["device"] = str(getattr(oracle, "device", "cpu"))  # the device really used (numpy problems: cpu)
        w = topo.mixing_matrix()
        ctx = NodeContext.from_matrix(w, peer_id, topo.adjacency())
        if resume:
            ck = checkpoint.load(out, peer_id)
            ck.check(algo.name, algo.params)
            ck.restore_oracle_rng(oracle)
            state = ck.state
            result["resumed_from"] = {"round": ck.round, "t": state.t}
            logger.info("peer %d resumes from its checkpoint of round %d (iteration %d)", peer_id, ck.round, state.t)
        else:
            state = algo.init(oracle, ctx)
        transport = GrpcTransport(
            Identity(peer_id, run.algorithm, run.hash(), topo.fingerprint, topo.name),
            topo, net.tls_files(peer_id), horizon=run.max_ahead * algo.period, chunk_bytes=run.chunk_bytes,
            data_path=run.data_path,
        )
        for ch, specs in algo.channels(state, ctx).items():
            transport.mailbox.expect(ch, specs)
        transport.mailbox.max_round = run.iterations  # a message for a round beyond the run is refused
        transport.current_round = state.t
        transport.serve(listen)
        if listen:
            result["config"]["listen"] = listen
        result["serving_at"] = time.time()  # wall clock: the launcher's spawn time gives the start-up time
        result["outcome"] = "connecting"
        _write_json(status_file, {"peer": peer_id, "state": "connecting", "round": 0, "rounds": run.rounds})
        reached = transport.start(run.connect_timeout)
        missing = sorted(set(transport.neighbours) - reached)
        if missing:
            errors = {j: transport.last_errors.get(j, "") for j in missing}
            if algo.needs_every_neighbour_at_start() and state.t == 0:
                pairs = [(min(peer_id, j), max(peer_id, j)) for j in missing]
                raise TransportError(f"peer {peer_id}: {run.algorithm} needs every pair of peers to connect before "
                                     f"training (edge selection on the complete graph), but pair(s) {pairs} could not "
                                     f"connect within {run.connect_timeout:g} s: {errors}")
            if run.on_missing == "fail":
                raise TransportError(f"peer {peer_id}: neighbour(s) {missing} unreachable after "
                                     f"{run.connect_timeout:g} s: {errors}")
            logger.warning("peer %d starts without neighbour(s) %s: %s", peer_id, missing, errors)
            result["unreached_at_start"] = {str(j): e for j, e in errors.items()}
        start_t = max([state.t, *transport.neighbour_rounds.values()])
        if start_t > state.t:
            logger.info("peer %d rejoins the network at iteration %d", peer_id, start_t)
        if start_t > 0:
            transport.advance(start_t)
        policy = FailurePolicy(run.on_missing, run.reweight, run.round_timeout, run.send_timeout)
        exchange = NeighbourExchange(transport, ctx.row, policy)
        result["outcome"] = "running"

        last_status = [0.0]
        link_stats = transport.link_stats

        def on_round(rec: dict[str, Any]) -> None:
            result["records"].append(rec)
            # appended as it goes: a killed peer keeps every finished round
            append_line(rounds_file, json.dumps(_clean(rec), allow_nan=False))
            now = time.monotonic()
            if now - last_status[0] < STATUS_EVERY_S and rec["round"] < run.rounds:
                return   # the progress file is for eyes and the launcher: not rewritten faster than this
            last_status[0] = now
            _write_json(status_file, {"peer": peer_id, "state": "running", "round": rec["round"], "rounds": run.rounds,
                                      "train_loss": rec["train_loss"], "test_loss": rec["test_loss"],
                                      "missing": rec["missing"], "links": link_stats()})

        def on_checkpoint(st: NodeState, round_: int) -> None:
            if run.checkpoint_every and round_ % run.checkpoint_every == 0:
                checkpoint.save(out, peer_id, st, algorithm=algo.name, params=algo.params, round_=round_,
                                oracle=oracle, extra={"config_hash": run.hash()})

        node = run_node(algo, oracle, exchange, run.iterations, ctx=ctx, state=state, start_t=start_t,
                        eval_every=run.eval_every, min_round_seconds=run.min_round_seconds, on_round=on_round,
                        on_checkpoint=on_checkpoint, stop=stop)
        arrays = algo.output(node.state, oracle)
        atomic_write_bytes(out / f"peer-{peer_id}.npz", lambda fh: checkpoint.savez(fh, **arrays))
        result["report"] = algo.report(node.state, oracle, ctx)
        result["start_t"] = start_t
        result["final_t"] = node.state.t
        result["stats"] = transport.stats()
        if stop.is_set():
            result["outcome"], code = "stopped", EXIT_STOPPED
        elif isolated := never_heard(result["records"], transport.neighbours):
            result["outcome"], result["error"], code = "isolated", isolated, EXIT_UNREACHABLE
            logger.error("peer %d: %s", peer_id, isolated)
        elif diverged := node_divergence(node.state.theta, *final_losses(result["records"])):
            result["outcome"], result["error"], code = "diverged", diverged, EXIT_ERROR
            logger.error("peer %d: %s", peer_id, diverged)
        else:
            result["outcome"] = "done"
    except (ConfigError, DataError) as exc:
        result["outcome"], result["error"], code = "config-error", str(exc), EXIT_CONFIG
        logger.error("peer %d: configuration error: %s", peer_id, exc)
    except HandshakeRefused as exc:
        result["outcome"], result["error"], code = "refused", str(exc), EXIT_REFUSED
        logger.error("peer %d: %s", peer_id, exc)
    except RoundFailed as exc:
        result["outcome"], result["error"], code = "round-failed", str(exc), EXIT_ROUND_FAILED
        logger.error("%s", exc)
    except ListenError as exc:
        result["outcome"], result["error"], code = "bind-failed", str(exc), EXIT_BIND
        logger.error("%s", exc)
    except TransportError as exc:
        result["outcome"], result["error"], code = "unreachable", str(exc), EXIT_UNREACHABLE
        logger.error("%s", exc)
    except ResultsWriteError as exc:  # a round's record, the checkpoint, the output arrays, the status file
        reason = write_failed(exc, network_file, peer_id, out)
        result["outcome"], result["error"], code = "write-failed", reason, EXIT_WRITE
        logger.error("peer %d: %s", peer_id, reason)
    except Exception as exc:
        result["outcome"], code = "error", EXIT_ERROR
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
        logger.exception("peer %d failed", peer_id)
    finally:
        result["seconds"] = time.monotonic() - t_begin
        result["max_rss_mb"] = peak_rss_mb()
        result["torch_imported"] = "torch" in sys.modules
        if transport is not None:
            result["links"] = transport.link_stats()
            transport.close()
        code = _finish(out, peer_id, result, status_file, network_file, code)
    return code


def main(network_file: str, peer_id: int, out_dir: str, overrides: dict[str, Any] | None = None,
         insecure: bool = False, resume: bool = False, device: str | None = None, listen: str | None = None) -> int:
    """Process entry point: logging to stderr, SIGTERM/SIGINT stop the loop (bounded), exit code."""
    logging.basicConfig(level=os.environ.get("GRAPHFL_LOG", "INFO"),
                        format=f"%(asctime)s peer-{peer_id} %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    malloc = keep_freed_memory()  # a peer reuses a few model-sized buffers every round (no page faults)

    def handler(signum: int, frame: Any) -> None:
        logger.warning("peer %d: signal %d, stopping after the current step", peer_id, signum)
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if os.environ.get("GRAPHFL_PROFILE"):  # developer aid: cProfile of the peer's main thread
            import cProfile  # only under GRAPHFL_PROFILE

            prof = cProfile.Profile()
            try:
                return prof.runcall(run_peer, network_file, peer_id, out_dir, overrides, insecure, stop, resume,
                                    device, listen, malloc)
            finally:
                prof.dump_stats(str(Path(out_dir) / f"peer-{peer_id}.prof"))
        return run_peer(network_file, peer_id, out_dir, overrides, insecure, stop, resume, device, listen, malloc)
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)
