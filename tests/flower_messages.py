"""Build a Flower ``Message`` in a test, outside any run."""

from __future__ import annotations

from flwr.app import Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity


def message_in_a_run(content: RecordDict, message_type: str = "train") -> Message:
    """``Message(content, dst_node_id=1, message_type=...)`` under a stand-in task identity.

    Flower builds Messages inside a run (their metadata reads ``TaskIdentity``); the identity is
    set to run 1, node 1, task 1 for the construction and put back afterwards.
    """
    saved = TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    try:
        return Message(content, dst_node_id=1, message_type=message_type)
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved
