"""Fast path ``object-hash-once``: a ClientApp's reply hashed once where it is made.

A Flower message travels as a tree of content-addressed objects: each object's id is the SHA-256
of its deflated bytes. A ClientApp's ``push_message`` (``flwr.supernode.runtime.run_clientapp``)
computes the reply's id outside Flower's ``no_object_id_recompute`` context and then again, for
every object of the tree, inside it: the reply is hashed twice where it is produced.
:func:`push_message` is that push with the reply's id computed inside the same context as the
tree: the same requests and the same ids as Flower's, each object hashed once.

The object stores keep Flower's check of every id against its content (``verify=True``) in the
SuperLink and in every SuperNode. A SuperNode's store is content-addressed and shared between
runs and messages, and ClientApps of other runs write to it through the Runtime API; an
unchecked id there would let content pushed under a forged id be served to a later message
that names the same id.

Off (:mod:`graphfl.flowerx.policy`): Flower's ``push_message``. Stock SuperNodes and the
SuperLink are not affected either way.
"""

from __future__ import annotations

import logging
from typing import Any

from graphfl.flowerx.checks import first_reason, lacks_attributes, lacks_source
from graphfl.flowerx.policy import FastPath, decide

logger = logging.getLogger(__name__)

FAST_PATH = FastPath("object-hash-once", "a ClientApp's reply hashed once where it is made",
                     "Flower hashes a reply twice in the ClientApp")

_PUSH_NAMES = ("no_object_id_recompute", "get_object_tree", "get_all_nested_objects", "push_objects",
               "make_push_object_fn_protobuf", "remove_content_from_message", "message_to_proto",
               "PushAppMessagesRequest", "Node")
_PUSH_NEEDLES = ('message.metadata.__dict__["_message_id"] = message.object_id', "with no_object_id_recompute():",
                 "get_object_tree(message)", "PushAppMessagesRequest(", "get_all_nested_objects(message)",
                 "push_objects(", "object_ids_to_push=object_ids_to_push")


def check() -> str | None:
    """Why hashing once does not fit this Flower's ClientApp reply push, or ``None``."""
    from flwr.supernode.runtime import run_clientapp as rc

    return first_reason(
        lacks_attributes(rc, (*_PUSH_NAMES, "push_message")),
        lacks_source(rc.push_message, "ClientApp reply push", _PUSH_NEEDLES),
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
