"""Names of the fields that cross a process boundary between the server and a client.

One spelling each, used by the Flower adapter, the ClientApp, the request handler and the
round loop (a typo in one of them would otherwise fail silently as a missing metric).
"""

from __future__ import annotations

# Records of a message's RecordDict
ARRAYS = "arrays"
"""Record with the payload (server -> client) or the update (client -> server): inline or packed
(:func:`graphfl.common.records.arrays_record`), or a plain ``ArrayRecord`` from other Flower code."""
CONFIG = "config"
"""ConfigRecord with the payload's scalars and the graphfl control keys below."""
METRICS = "metrics"
"""MetricRecord of a reply."""
STATE = "graphfl-state"
"""ArrayRecord in the ClientApp's ``context.state`` holding the client's persistent state."""
STATE_META = "graphfl-state-meta"
"""ConfigRecord in ``context.state``: ``round`` of the last non-join message that produced the state
(absent: no state of this Flower run yet, so a persisted one may be loaded)."""
PACKED = "graphfl.packed"
"""Key of a record's tensors packed into one blob: the single ``Array`` of a packed ``ArrayRecord``
(:func:`graphfl.common.records.arrays_to_record`, one object on the wire instead of one per tensor),
or the single ``bytes`` value of an inline ``ConfigRecord`` (:func:`graphfl.common.records.arrays_record`)."""
COMPRESSED_PREFIX = "graphfl.z/"
"""Upload array keys under this prefix are compressed parts (:mod:`graphfl.common.compress`)."""

# Control keys inside the config record (prefixed so payload scalars cannot collide)
CONTROL_PREFIX = "graphfl."
ROUND = "graphfl.round"
KIND = "graphfl.kind"
EVAL_FIRST = "graphfl.eval-first"
PHASE = "graphfl.phase"

# Request kinds
JOIN, TRAIN, EVALUATE = "join", "train", "evaluate"

# Reply metrics
PARTITION_ID = "partition-id"
NUM_PARTITIONS = "num-partitions"
NUM_EXAMPLES = "num-examples"
CLIENT_SECONDS = "client-seconds"
CLIENT_BOOT_SECONDS = "client-boot-seconds"
CLIENT_ON_GPU = "client-on-gpu"
"""1.0 when the client trained on a GPU (its resolved torch device is ``cuda``/``cuda:N``), else 0.0."""
STATE_RESTORED = "state-restored"
"""The round of the saved client state a client loaded from its state folder for this request
(present only when it did: after a SuperNode restart or a ``--resume``)."""
EVAL_PREFIX = "eval."
"""Reply metrics under this prefix are a client's evaluation (``eval.test_loss``); the others
describe its training."""

# SuperNode node-config keys
NODE_PARTITION_ID = "partition-id"
NODE_NUM_PARTITIONS = "num-partitions"
NODE_DEVICE = "device"
NODE_STATE_DIR = "state-dir"
"""Folder where the client mirrors its persistent state (:mod:`graphfl.client.state_store`)."""
NODE_DATA_DIR = "data-dir"
"""This SuperNode's data folder (its own files, e.g. ``device-<id>.csv``); overrides the run's ``data-dir``."""

# Noisy uplink channel (seed 002; graphfl.client.noisy_channel)
MASK_PREFIX = "graphfl-mask/"
"""A reply's ArrayRecord ``name`` that passed the noisy channel travels with the ArrayRecord
``MASK_PREFIX + name`` of the same keys: bool arrays, ``True`` = entry received."""
RUN_SEED = "seed"
CHANNEL_NOISE = "channel.noise"
CHANNEL_MISSING = "channel.missing"
"""Run-config keys the channel mod reads (absent: the channel is off)."""
