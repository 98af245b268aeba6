from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Hello(_message.Message):
    __slots__ = ("peer_id", "algorithm", "config_hash", "topology_version", "network")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    peer_id: int
    algorithm: str
    config_hash: str
    topology_version: str
    network: str
    def __init__(self, peer_id: _Optional[int] = ..., algorithm: _Optional[str] = ..., config_hash: _Optional[str] = ..., topology_version: _Optional[str] = ..., network: _Optional[str] = ...) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("accepted", "reason", "peer_id", "round", "algorithm", "config_hash", "topology_version", "data_port", "data_token")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_VERSION_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    DATA_TOKEN_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    peer_id: int
    round: int
    algorithm: str
    config_hash: str
    topology_version: str
    data_port: int
    data_token: bytes
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., peer_id: _Optional[int] = ..., round: _Optional[int] = ..., algorithm: _Optional[str] = ..., config_hash: _Optional[str] = ..., topology_version: _Optional[str] = ..., data_port: _Optional[int] = ..., data_token: _Optional[bytes] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class Header(_message.Message):
    __slots__ = ("tensors", "scalars")
    class ScalarsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SCALARS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    scalars: _containers.ScalarMap[str, float]
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., scalars: _Optional[_Mapping[str, float]] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("sender", "round", "channel", "header", "data")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    sender: int
    round: int
    channel: str
    header: Header
    data: bytes
    def __init__(self, sender: _Optional[int] = ..., round: _Optional[int] = ..., channel: _Optional[str] = ..., header: _Optional[_Union[Header, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("accepted", "reason", "bytes_received")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    bytes_received: int
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., bytes_received: _Optional[int] = ...) -> None: ...
