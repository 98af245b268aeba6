"""Timing hooks of ``graphfl bench deploy-perhop``, loaded by every Python process of a profiled deployment.

This folder goes first on ``PYTHONPATH`` only while :mod:`graphfl.bench.deploy_perhop` runs a
deployment, and the hooks switch on only when ``GRAPHFL_PERHOP_TRACE`` names a folder. Each
process then appends one JSON line per event to ``<folder>/trace-<pid>.jsonl``:

* ``rpc_c``: one protobuf-over-HTTP request of Flower's ``ProtobufClient._unary_unary`` (the
  Fleet, ServerApp and ClientApp APIs of this Flower are HTTP/1.1 POSTs of protobuf bodies), named
  ``<path>|<rpc method>``, with request and reply sizes (protobuf ``ByteSize``); also a unary-unary
  gRPC call (``grpc._channel``), and ``rpc_s`` a gRPC handler, where a process still uses gRPC;
* ``act``: one call of a function that does one activity (graphfl's array packing, Flower's
  serialisation of an array, chunking, deflate/inflate of a message object, SHA-256 object ids,
  the SuperLink's object store, content validation), with its exclusive wall seconds (``excl``)
  and exclusive CPU seconds of its thread (``cpu``, ``time.thread_time``; nested timed calls of
  the same thread are subtracted from both);
* ``phase``: one :func:`graphfl.server.rounds.run_phase` of the ServerApp (the round's window).

Times are ``time.time()`` (one clock for all processes of the machine). Nothing is changed in
what the functions do; the hooks only time them. Not a dependency of graphfl's own code.
"""

from __future__ import annotations

import os

if os.environ.get("GRAPHFL_PERHOP_TRACE"):  # pragma: no branch - only under the bench
    import hashlib
    import importlib.abc
    import importlib.machinery
    import json
    import sys
    import threading
    import time
    from typing import Any

    _DIR = os.environ["GRAPHFL_PERHOP_TRACE"]
    _LOCK = threading.Lock()
    _LOCAL = threading.local()
    _FH: list[Any] = []

    def _role() -> str:
        try:  # the command line as started (sys.argv is still "-m" while a -m module imports)
            with open("/proc/self/cmdline", "rb") as fh:
                argv = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
        except OSError:
            argv = list(sys.argv)
        head = " ".join(os.path.basename(a).replace("graphfl.deploy.", "") for a in argv[:4])
        for key, name in (("superlink", "superlink"), ("warm worker", "worker"), ("warm executor", "executor"),
                          ("supernode", "supernode"), ("superexec", "superexec"), ("serverapp", "serverapp"),
                          ("clientapp", "clientapp"), ("flwr", "flwr")):
            if key in head:
                return name
        return head or "python"

    def _emit(ev: dict[str, Any]) -> None:
        with _LOCK:
            if not _FH:
                _FH.append(open(os.path.join(_DIR, f"trace-{os.getpid()}.jsonl"), "a", buffering=1))
                _FH[0].write(json.dumps({"kind": "proc", "pid": os.getpid(), "role": _role(),
                                         "ppid": os.getppid(), "t": time.time()}) + "\n")
            ev["pid"] = os.getpid()
            _FH[0].write(json.dumps(ev) + "\n")

    def _enter() -> tuple[float, float]:
        for attr in ("stack", "cstack"):
            if getattr(_LOCAL, attr, None) is None:
                setattr(_LOCAL, attr, [])
        _LOCAL.stack.append(0.0)
        _LOCAL.cstack.append(0.0)
        return time.time(), time.thread_time()

    def _leave(t0: float, c0: float) -> tuple[float, float, float]:
        """End time, exclusive wall seconds and exclusive CPU seconds of this thread's innermost timed call."""
        t1, c1 = time.time(), time.thread_time()
        child, cchild = _LOCAL.stack.pop(), _LOCAL.cstack.pop()
        if _LOCAL.stack:
            _LOCAL.stack[-1] += t1 - t0
            _LOCAL.cstack[-1] += c1 - c0
        return t1, (t1 - t0) - child, (c1 - c0) - cchild

    def _timed(kind: str, name: str, fn: Any, t_extra: Any = None) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = _enter()
            try:
                return fn(*args, **kwargs)
            finally:
                t1, excl, cpu = _leave(t0, c0)
                ev = {"kind": kind, "name": name, "t0": t0, "t1": t1, "excl": excl, "cpu": cpu}
                if t_extra is not None:
                    try:
                        ev.update(t_extra(args))
                    except Exception:  # noqa: BLE001 - a size we cannot read is left out
                        pass
                _emit(ev)
        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper

    # --- SHA-256 object ids: patched before any Flower module binds the name -------------------
    _sha = hashlib.sha256

    def _sha256(*args: Any, **kwargs: Any) -> Any:
        return _timed_sha(*args, **kwargs)

    _timed_sha = _timed("act", "hash_sha256", _sha, lambda a: {"bytes": len(a[0]) if a else 0})
    hashlib.sha256 = _sha256

    # --- gRPC: caller side and handler side, patched when grpc's modules are imported ----------
    def _patch_grpc_channel(_channel: Any) -> None:
        def method_of(obj: Any) -> str:
            m = getattr(obj, "_method", b"")
            return m.decode() if isinstance(m, bytes) else str(m)

        for attr in ("__call__", "with_call"):
            orig = getattr(_channel._UnaryUnaryMultiCallable, attr)

            def make(orig: Any = orig, attr: str = attr) -> Any:
                def call(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
                    t0, c0 = _enter()
                    out = None
                    try:
                        out = orig(self, request, *args, **kwargs)
                        return out
                    finally:
                        t1, excl, cpu = _leave(t0, c0)
                        resp = out[0] if (attr == "with_call" and isinstance(out, tuple)) else out
                        _emit({"kind": "rpc_c", "name": method_of(self), "t0": t0, "t1": t1,
                               "excl": excl, "cpu": cpu, "req": _size(request), "resp": _size(resp)})
                return call
            setattr(_channel._UnaryUnaryMultiCallable, attr, make())

    def _patch_grpc(grpc: Any) -> None:
        orig_handler = grpc.unary_unary_rpc_method_handler

        def handler(behavior: Any, request_deserializer: Any = None, response_serializer: Any = None) -> Any:
            name = getattr(behavior, "__name__", "?")

            def served(request: Any, context: Any) -> Any:
                t0, c0 = _enter()
                out = None
                try:
                    out = behavior(request, context)
                    return out
                finally:
                    t1, excl, cpu = _leave(t0, c0)
                    _emit({"kind": "rpc_s", "name": name, "t0": t0, "t1": t1, "excl": excl, "cpu": cpu,
                           "req": _size(request), "resp": _size(out)})
            return orig_handler(served, request_deserializer, response_serializer)

        grpc.unary_unary_rpc_method_handler = handler

    def _timed_http(fn: Any) -> Any:
        """A protobuf-over-HTTP call of Flower's ``ProtobufClient`` (one HTTP POST), as ``rpc_c``."""
        def call(self: Any, **kwargs: Any) -> Any:
            t0, c0 = _enter()
            out = None
            try:
                out = fn(self, **kwargs)
                return out
            finally:
                t1, excl, cpu = _leave(t0, c0)
                _emit({"kind": "rpc_c", "name": f"{kwargs.get('path')}|{kwargs.get('rpc_method')}", "t0": t0,
                       "t1": t1, "excl": excl, "cpu": cpu, "req": _size(kwargs.get("request")),
                       "resp": _size(out)})
        return call

    def _size(msg: Any) -> int | None:
        try:
            return int(msg.ByteSize())
        except Exception:  # noqa: BLE001
            return None

    # --- Flower's activities, patched when their module is imported -----------------------------
    _TARGETS: dict[str, list[tuple[str, str, str]]] = {
        "flwr.app.message.array": [("Array", "from_numpy_ndarray", "serialise_array"),
                                   ("Array", "numpy", "deserialise_array"),
                                   ("Array", "slice_array", "chunk_array"),
                                   ("Array", "deflate", "deflate"), ("Array", "inflate", "inflate")],
        "flwr.app.message.arraychunk": [("ArrayChunk", "deflate", "deflate"), ("ArrayChunk", "inflate", "inflate")],
        "flwr.app.message.arrayrecord": [("ArrayRecord", "deflate", "deflate"), ("ArrayRecord", "inflate", "inflate")],
        "flwr.app.message.recorddict": [("RecordDict", "deflate", "deflate"), ("RecordDict", "inflate", "inflate")],
        "flwr.app.message.message": [("Message", "deflate", "deflate"), ("Message", "inflate", "inflate")],
        "flwr.supercore.object_store.in_memory_object_store": [("InMemoryObjectStore", "put", "object_store_put"),
                                                              ("InMemoryObjectStore", "get", "object_store_get")],
        "flwr.supercore.inflatable.inflatable_utils": [("", "validate_object_content", "validate_object")],
        "graphfl.server.rounds": [("", "run_phase", "phase")],
        # graphfl's fast path array-fewer-copies replaces ArrayChunk.deflate/inflate and Array.inflate
        # by these (looked up when it installs them): the same activities
        "graphfl.flowerx.array_copies": [("", "deflate_chunk", "deflate"), ("", "inflate_chunk", "inflate"),
                                         ("", "inflate_array", "inflate")],
        "graphfl.common.records": [("", "pack_arrays", "graphfl_pack_arrays"),
                                   ("", "unpack_arrays", "graphfl_unpack_arrays"),
                                   ("", "_packed_array_record", "graphfl_array_record")],
        "grpc": [], "grpc._channel": [],
        "flwr.supercore.protobuf.client": [("ProtobufClient", "_unary_unary", "rpc")],
    }

    def _patch_module(mod: Any) -> None:
        if mod.__name__ == "grpc":
            _patch_grpc(mod)
        elif mod.__name__ == "grpc._channel":
            _patch_grpc_channel(mod)
        for cls_name, attr, label in _TARGETS.get(mod.__name__, []):
            if not cls_name:
                fn = getattr(mod, attr, None)
                if fn is None:
                    continue
                if label == "phase":
                    setattr(mod, attr, _timed("phase", "run_phase", fn, lambda a: {"round": int(a[2])}))
                else:
                    setattr(mod, attr, _timed("act", label, fn))
                continue
            cls = getattr(mod, cls_name, None)
            raw = cls.__dict__.get(attr) if cls is not None else None
            if raw is None:
                continue
            if isinstance(raw, classmethod):
                setattr(cls, attr, classmethod(_timed("act", label, raw.__func__)))
            elif isinstance(raw, staticmethod):
                setattr(cls, attr, staticmethod(_timed("act", label, raw.__func__)))
            elif label == "rpc":
                setattr(cls, attr, _timed_http(raw))
            elif callable(raw):
                setattr(cls, attr, _timed("act", label, raw))

    class _Loader(importlib.abc.Loader):
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def create_module(self, spec: Any) -> Any:
            return self.inner.create_module(spec)

        def exec_module(self, module: Any) -> None:
            self.inner.exec_module(module)
            try:
                _patch_module(module)
            except Exception as exc:  # noqa: BLE001 - a hook that does not fit is reported, the import stands
                _emit({"kind": "hook_error", "module": module.__name__, "error": repr(exc)})

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
            if name not in _TARGETS:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
            return spec

    sys.meta_path.insert(0, _Finder())
