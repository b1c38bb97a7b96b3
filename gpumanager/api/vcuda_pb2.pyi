from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class VDeviceRequest(_message.Message):
    __slots__ = ("bus_id", "pod_uid", "container_name", "container_id")
    BUS_ID_FIELD_NUMBER: _ClassVar[int]
    POD_UID_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_NAME_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    bus_id: str
    pod_uid: str
    container_name: str
    container_id: str
    def __init__(self, bus_id: _Optional[str] = ..., pod_uid: _Optional[str] = ..., container_name: _Optional[str] = ..., container_id: _Optional[str] = ...) -> None: ...

class VDeviceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
