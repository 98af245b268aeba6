"""Conversion between graphfl's named numpy arrays and Flower's ``ArrayRecord``.

Used by both halves of the Flower runtime (the ServerApp's strategy adapter and the
ClientApp), so it lives in the kernel; it imports only ``flwr.app`` (no server code).
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord

from graphfl.common.types import Arrays


def arrays_to_record(arrays: Arrays) -> ArrayRecord:
    """Named numpy arrays -> ``ArrayRecord`` (order kept; arrays made contiguous)."""
    rec = ArrayRecord()
    for key, value in arrays.items():
        arr = np.asarray(value)
        rec[key] = Array(np.ascontiguousarray(arr).reshape(arr.shape))  # keeps 0-d arrays 0-d
    return rec


def record_to_arrays(record: ArrayRecord) -> Arrays:
    """``ArrayRecord`` -> numpy dict (order kept)."""
    return {key: arr.numpy() for key, arr in record.items()}
