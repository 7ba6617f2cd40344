from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TierKeys(_message.Message):
    __slots__ = ("namespace", "block_hashes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[str] = ..., block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class TierBlock(_message.Message):
    __slots__ = ("block_hash", "data", "checksum")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    block_hash: int
    data: bytes
    checksum: int
    def __init__(self, block_hash: _Optional[int] = ..., data: _Optional[bytes] = ..., checksum: _Optional[int] = ...) -> None: ...

class TierPutRequest(_message.Message):
    __slots__ = ("namespace", "blocks")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    blocks: _containers.RepeatedCompositeFieldContainer[TierBlock]
    def __init__(self, namespace: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[TierBlock, _Mapping]]] = ...) -> None: ...

class TierPutReply(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    def __init__(self, stored: _Optional[int] = ...) -> None: ...

class TierLookupReply(_message.Message):
    __slots__ = ("present",)
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    present: int
    def __init__(self, present: _Optional[int] = ...) -> None: ...

class TierGetRequest(_message.Message):
    __slots__ = ("keys", "max_bytes")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    keys: TierKeys
    max_bytes: int
    def __init__(self, keys: _Optional[_Union[TierKeys, _Mapping]] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class TierGetReply(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[TierBlock]
    def __init__(self, blocks: _Optional[_Iterable[_Union[TierBlock, _Mapping]]] = ...) -> None: ...
