"""Fast path ``object-hash-once`` (graphfl.flowerx.hash_once): a reply hashed once where it is
produced, with the same requests and ids as Flower's; Flower's behaviour when the fast path is off;
and a graphfl SuperNode's object store that still refuses content under a forged id."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.supercore.inflatable import inflatable_object
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
from flwr.supercore.object_store import in_memory_object_store
from flwr.supercore.object_store.object_store_factory import ObjectStoreFactory
from flwr.supercore.task_identity import TaskIdentity
from flwr.supernode.runtime import run_clientapp as rc

from graphfl.flowerx import hash_once, policy


@pytest.fixture
def fresh(monkeypatch):
    for name, value in (("_task_id", 3), ("_run_id", 5), ("_node_id", 1)):   # a task's identity, as
        monkeypatch.setattr(TaskIdentity, name, value)                       # pull_task_input sets it
    monkeypatch.delenv(policy.VERSION_ENV, raising=False)
    monkeypatch.delenv(policy.OFF_ENV, raising=False)
    policy.forget()
    yield monkeypatch
    policy.forget()


class _Ack:
    def __init__(self, **kw: object) -> None:
        self.__dict__.update(kw)


class RecordingRuntime:
    """Stands in for the SuperNode's Runtime API client: records what a reply push sends."""

    def __init__(self) -> None:
        self.messages: list[bytes] = []
        self.pushed: dict[str, bytes] = {}

    def PushMessages(self, request):
        self.messages.append(request.SerializeToString(deterministic=True))
        tree = request.message_object_trees[0]
        ids: list[str] = []
        stack = [tree]
        while stack:
            node = stack.pop()
            ids.append(node.object_id)
            stack.extend(node.children)
        return _Ack(objects_to_push=ids, session_id="s")

    def PushObject(self, request):
        self.pushed[request.object_id] = bytes(request.object_content)
        return _Ack(stored=True)


def _reply() -> tuple[Message, Context]:
    rng = np.random.default_rng(0)
    arrays = ArrayRecord({"w": Array(rng.standard_normal((300, 200)).astype(np.float32)),
                          "b": Array(rng.standard_normal(50).astype(np.float32))})
    incoming = Message(RecordDict({"arrays": arrays}), dst_node_id=7, message_type="train")
    incoming.metadata.__dict__["_message_id"] = incoming.object_id
    reply = Message(RecordDict({"arrays": ArrayRecord({"w": Array(rng.standard_normal((300, 200)).astype(np.float32))}),
                                "metrics": ConfigRecord({"n": 3})}), reply_to=incoming)
    return reply, Context(run_id=5, node_id=7, node_config={}, state=RecordDict(), run_config={})


def _count_hashes(monkeypatch) -> list[int]:
    seen: list[int] = []
    real = inflatable_object.get_object_id

    def counting(content: bytes) -> str:
        seen.append(len(content))
        return real(content)

    for module in (inflatable_object, in_memory_object_store):   # the modules that hash here
        monkeypatch.setattr(module, "get_object_id", counting)
    return seen


def _push(fn, seen: list[int], reply: Message, context: Context) -> tuple[RecordingRuntime, list[int]]:
    client = RecordingRuntime()
    seen.clear()
    fn(client, copy.deepcopy(reply), context)
    return client, list(seen)


def test_a_reply_is_hashed_once_with_flowers_requests_and_ids(fresh) -> None:
    seen = _count_hashes(fresh)
    reply, context = _reply()
    flower, flower_hashes = _push(rc.push_message, seen, reply, context)
    ours, our_hashes = _push(hash_once.push_message, seen, reply, context)
    assert ours.messages == flower.messages          # same PushMessages request, byte for byte
    assert ours.pushed == flower.pushed              # same objects, same ids, same content
    assert len(ours.pushed) >= 6
    assert len(our_hashes) == len(ours.pushed)       # one SHA-256 per object
    assert sorted(our_hashes) == sorted(len(c) for c in ours.pushed.values())
    chunk = max(len(c) for c in flower.pushed.values())   # the array's bytes: Flower hashes them twice
    assert flower_hashes.count(chunk) == 2 and our_hashes.count(chunk) == 1


def test_off_it_is_flowers_push(fresh) -> None:
    fresh.setenv(policy.OFF_ENV, "object-hash-once")
    client, hashes = _push(hash_once.push_message, _count_hashes(fresh), *_reply())
    assert hashes.count(max(len(c) for c in client.pushed.values())) == 2


def _tree_and_contents() -> tuple[object, dict[str, bytes]]:
    reply, _ = _reply()
    with inflatable_object.no_object_id_recompute():
        tree = get_object_tree(reply)
        contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(reply).items()}
    return tree, contents


def test_a_graphfl_supernodes_store_refuses_content_under_a_forged_id(fresh) -> None:
    """The store is content-addressed and shared between runs: content a ClientApp of another run
    pushed under a forged id would be served to every later message naming that id, so the
    SuperNode's own store must keep checking ids (the SuperLink's check comes too late)."""
    import sys

    import flwr.supernode.cli as flower_cli
    from flwr.supernode import start_client_internal as sci

    from graphfl.deploy import supernode as wrapper

    tree, contents = _tree_and_contents()
    big, small = (o for o, c in sorted(contents.items(), key=lambda kv: -len(kv[1]))[:2])
    outcome: list[str] = []

    def flower_supernode() -> None:   # runs where Flower's SuperNode main would, after graphfl's set-up
        store = ObjectStoreFactory().store()
        store.preregister(5, tree)
        try:
            store.put(big, contents[small])
            outcome.append("accepted")
        except ValueError as err:
            outcome.append(str(err))

    for name in ("_pull_and_store_message", "pull_objects", "time"):   # install_fast_polls wraps these
        fresh.setattr(sci, name, getattr(sci, name))
    fresh.setattr(ObjectStoreFactory, "store", ObjectStoreFactory.store)
    fresh.setattr(sys, "argv", list(sys.argv))
    fresh.setattr(flower_cli, "flower_supernode", flower_supernode)
    wrapper.main(["--clientapp-mode", "cold", "--polls", "fast", "--", "--insecure", "--superlink", "127.0.0.1:9"])
    assert outcome and "does not match content hash" in outcome[0], outcome
