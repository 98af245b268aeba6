"""Fast path ``object-hash-once``: a message's SHA-256 object ids computed once per process and hop.

A Flower message travels as a tree of content-addressed objects: each object's id is the SHA-256
of its deflated bytes. Stock Flower hashes every byte of a message several times on its way
ServerApp → SuperLink → SuperNode → ClientApp and back:

* a ClientApp's ``push_message`` (``flwr.supernode.runtime.run_clientapp``) computes the reply's
  id outside Flower's ``no_object_id_recompute`` context and then again, for every object of the
  tree, inside it: the reply is hashed twice where it is produced;
* every object store ``put`` re-hashes the content it receives to check it against its id
  (``InMemoryObjectStore.put`` / ``SqlObjectStore.put`` with ``verify=True``), in the SuperLink
  *and* in every SuperNode, so a message is re-hashed at each store it passes.

Where an object's id must be checked is where content enters a store that other parties read
from: the SuperLink, which takes objects from every SuperNode and shares identical objects
between messages (an unchecked id there would let one node's push stand in for another's).
That check stays. A SuperNode's store is not such a place: what it receives comes either from
the SuperLink (which checked each id when the object entered it) or from its own ClientApp,
and everything it forwards is checked again by the SuperLink. So this fast path:

* :func:`push_message` -- the ClientApp's reply push with the reply's ids computed once (the same
  requests, the same ids as Flower's ``push_message``);
* :func:`install_supernode_store` -- in a graphfl SuperNode process, the object store skips the
  SHA-256 re-check of each ``put`` and keeps Flower's structural validation of the content
  (head, children ids, body length), so malformed content is refused where it was before.

Off (:mod:`graphfl.flowerx.policy`): Flower's ``push_message`` and a verifying SuperNode store.
Stock SuperNodes and the SuperLink are not affected either way.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from graphfl.flowerx.checks import first_reason, lacks_attributes, lacks_source
from graphfl.flowerx.policy import FastPath, decide

logger = logging.getLogger(__name__)

FAST_PATH = FastPath("object-hash-once", "message object ids hashed once per process and hop",
                     "Flower hashes a reply twice in the ClientApp and re-hashes every object the SuperNode stores")

_PUSH_NAMES = ("no_object_id_recompute", "get_object_tree", "get_all_nested_objects", "push_objects",
               "make_push_object_fn_protobuf", "remove_content_from_message", "message_to_proto",
               "PushAppMessagesRequest", "Node")
_PUSH_NEEDLES = ('message.metadata.__dict__["_message_id"] = message.object_id', "with no_object_id_recompute():",
                 "get_object_tree(message)", "PushAppMessagesRequest(", "get_all_nested_objects(message)",
                 "push_objects(", "object_ids_to_push=object_ids_to_push")
_PUT_NEEDLES = ("if self.verify:", "get_object_id(object_content)", "validate_object_content(content=object_content)")


def check() -> str | None:
    """Why hashing once does not fit this Flower's reply push and object stores, or ``None``."""
    from flwr.supercore.inflatable import inflatable_utils as iu
    from flwr.supercore.object_store import object_store_factory as osf
    from flwr.supercore.object_store.in_memory_object_store import InMemoryObjectStore
    from flwr.supercore.object_store.sql_object_store import SqlObjectStore
    from flwr.supernode.runtime import run_clientapp as rc

    return first_reason(
        lacks_attributes(rc, (*_PUSH_NAMES, "push_message")),
        lacks_source(rc.push_message, "ClientApp reply push", _PUSH_NEEDLES),
        lacks_attributes(iu, ("validate_object_content",)),
        None if callable(getattr(getattr(osf, "ObjectStoreFactory", None), "store", None))
        else "flwr.supercore.object_store.object_store_factory has no ObjectStoreFactory.store",
        lacks_source(InMemoryObjectStore.put, "in-memory object store put", _PUT_NEEDLES),
        lacks_source(SqlObjectStore.put, "SQL object store put", _PUT_NEEDLES),
    )


def available() -> bool:
    """Whether the fast path is on in this process (:func:`graphfl.flowerx.policy.decide`)."""
    return decide(FAST_PATH, check)


def push_message(client: Any, message: Any, context: Any) -> None:
    """Push a ClientApp's reply ``message`` and its objects to the SuperNode (Runtime API ``client``).

    The requests and the ids are those of ``flwr.supernode.runtime.run_clientapp.push_message``
    (``PushMessages`` with the message and its object tree, then ``PushObject`` for each object
    the SuperNode asks for); only the reply's id is computed inside the same
    ``no_object_id_recompute`` context as the tree, so each object is hashed once. Off: Flower's
    ``push_message``.
    """
    from flwr.supernode.runtime import run_clientapp as rc

    if not available():
        rc.push_message(client, message, context)
        return
    with rc.no_object_id_recompute():
        message.metadata.__dict__["_message_id"] = message.object_id
        proto_message = rc.message_to_proto(rc.remove_content_from_message(message))
        object_tree = rc.get_object_tree(message)
        res = client.PushMessages(rc.PushAppMessagesRequest(messages_list=[proto_message],
                                                            message_object_trees=[object_tree]))
        del proto_message
        object_ids_to_push = set(res.objects_to_push)
        all_objects = rc.get_all_nested_objects(message)
        del message
        rc.push_objects(
            all_objects,
            rc.make_push_object_fn_protobuf(client.PushObject, rc.Node(node_id=context.node_id),
                                            run_id=context.run_id, session_id=res.session_id),
            object_ids_to_push=object_ids_to_push,
        )


def trust_store_ids(store: Any) -> Any:
    """Make ``store`` (a Flower ``ObjectStore`` with a ``verify`` flag) skip the SHA-256 re-check of each
    ``put`` while keeping the structural validation of the content; returns ``store``.

    For a SuperNode's store only (see the module docstring: the SuperLink checks every id that
    enters it). A store without ``verify`` or with it already off is returned unchanged.
    """
    if getattr(store, "verify", None) is not True or getattr(store, "graphfl_trusts_ids", False):
        return store
    from flwr.supercore.inflatable.inflatable_utils import validate_object_content

    put = store.put

    @functools.wraps(put)
    def validated_put(object_id: str, object_content: bytes) -> None:
        validate_object_content(content=object_content)
        put(object_id, object_content)

    store.verify = False
    store.put = validated_put
    store.graphfl_trusts_ids = True
    return store


def install_supernode_store() -> bool:
    """In this (SuperNode) process, every object store Flower's ``ObjectStoreFactory`` hands out
    trusts the ids it is given (:func:`trust_store_ids`). Idempotent; ``False`` (nothing changed)
    when the fast path is off here.
    """
    if not available():
        return False
    from flwr.supercore.object_store.object_store_factory import ObjectStoreFactory

    current = ObjectStoreFactory.store
    if getattr(current, "graphfl_hash_once", False):
        return True

    @functools.wraps(current)
    def store(self: Any) -> Any:
        return trust_store_ids(current(self))

    store.graphfl_hash_once = True  # type: ignore[attr-defined]
    ObjectStoreFactory.store = store  # type: ignore[method-assign]
    return True
