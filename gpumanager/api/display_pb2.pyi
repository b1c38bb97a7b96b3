from google.protobuf import empty_pb2 as _empty_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GraphResponse(_message.Message):
    __slots__ = ("graph",)
    GRAPH_FIELD_NUMBER: _ClassVar[int]
    graph: str
    def __init__(self, graph: _Optional[str] = ...) -> None: ...

class UsageResponse(_message.Message):
    __slots__ = ("usage",)
    class UsageEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: ContainerStat
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[ContainerStat, _Mapping]] = ...) -> None: ...
    USAGE_FIELD_NUMBER: _ClassVar[int]
    usage: _containers.MessageMap[str, ContainerStat]
    def __init__(self, usage: _Optional[_Mapping[str, ContainerStat]] = ...) -> None: ...

class ContainerStat(_message.Message):
    __slots__ = ("stat", "project", "user", "cluster", "spec")
    class StatEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Devices
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Devices, _Mapping]] = ...) -> None: ...
    class SpecEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Spec
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Spec, _Mapping]] = ...) -> None: ...
    STAT_FIELD_NUMBER: _ClassVar[int]
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    stat: _containers.MessageMap[str, Devices]
    project: str
    user: str
    cluster: str
    spec: _containers.MessageMap[str, Spec]
    def __init__(self, stat: _Optional[_Mapping[str, Devices]] = ..., project: _Optional[str] = ..., user: _Optional[str] = ..., cluster: _Optional[str] = ..., spec: _Optional[_Mapping[str, Spec]] = ...) -> None: ...

class Devices(_message.Message):
    __slots__ = ("dev",)
    DEV_FIELD_NUMBER: _ClassVar[int]
    dev: _containers.RepeatedCompositeFieldContainer[DeviceInfo]
    def __init__(self, dev: _Optional[_Iterable[_Union[DeviceInfo, _Mapping]]] = ...) -> None: ...

class DeviceInfo(_message.Message):
    __slots__ = ("id", "card_idx", "gpu", "mem", "pids", "device_mem")
    ID_FIELD_NUMBER: _ClassVar[int]
    CARD_IDX_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    MEM_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEM_FIELD_NUMBER: _ClassVar[int]
    id: str
    card_idx: str
    gpu: float
    mem: float
    pids: _containers.RepeatedScalarFieldContainer[int]
    device_mem: float
    def __init__(self, id: _Optional[str] = ..., card_idx: _Optional[str] = ..., gpu: _Optional[float] = ..., mem: _Optional[float] = ..., pids: _Optional[_Iterable[int]] = ..., device_mem: _Optional[float] = ...) -> None: ...

class VersionResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: str
    def __init__(self, version: _Optional[str] = ...) -> None: ...

class Spec(_message.Message):
    __slots__ = ("gpu", "mem")
    GPU_FIELD_NUMBER: _ClassVar[int]
    MEM_FIELD_NUMBER: _ClassVar[int]
    gpu: float
    mem: float
    def __init__(self, gpu: _Optional[float] = ..., mem: _Optional[float] = ...) -> None: ...
