"""gRPC server reflection that carries binbatch.proto's comments.

The proto's comments are the API's reference documentation, and users read them
through reflection (``grpcurl describe``, Postman).  The stock servicer of
grpcio-reflection answers from a descriptor pool with ``FileDescriptor.CopyToProto``,
which never copies ``source_code_info``: the descriptors compiled into
``binbatch_pb2`` have none, and a pool built from a descriptor set that has it
drops it all the same.  So the servicer here uses a pool built from the generated
descriptor set (``binbatch_descriptor_set.binpb``, written by ``proto/generate.py``
with ``--include_source_info``) for every lookup, and answers each file of that
set with the set's own bytes, comments included.  Other files (health, reflection
itself) come from the default pool, as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from binbatch_api.v1 import source_file_descriptors


def documented_pool(files: Mapping[str, bytes], others: Iterable[FileDescriptor]) -> descriptor_pool.DescriptorPool:
    """A pool holding ``files`` (serialized FileDescriptorProtos, dependencies
    first, as protoc's ``--include_imports`` writes them) and the compiled files
    ``others`` with their dependencies."""
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add_compiled(fd: FileDescriptor) -> None:
        if fd.name in added or fd.name in files:
            return
        for dep in fd.dependencies:
            add_compiled(dep)
        proto = descriptor_pb2.FileDescriptorProto()
        fd.CopyToProto(proto)
        pool.AddSerializedFile(proto.SerializeToString())
        added.add(fd.name)

    for fd in others:
        add_compiled(fd)
    for data in files.values():
        pool.AddSerializedFile(data)
    return pool


class DocumentedReflectionServicer(reflection.aio.ReflectionServicer):
    """The stock asyncio reflection servicer, answering ``files`` with their own
    bytes (which keep the comments) instead of the pool's copy (which does not)."""

    def __init__(self, service_names: Iterable[str], files: Mapping[str, bytes], others: Iterable[FileDescriptor]):
        super().__init__(tuple(service_names), pool=documented_pool(files, others))
        self._files = dict(files)

    def _documented(self, response: reflection_pb2.ServerReflectionResponse) -> reflection_pb2.ServerReflectionResponse:
        if response.HasField("file_descriptor_response"):
            protos = response.file_descriptor_response.file_descriptor_proto
            for i, data in enumerate(protos):
                name = descriptor_pb2.FileDescriptorProto.FromString(data).name
                if name in self._files:
                    protos[i] = self._files[name]
        return response

    async def ServerReflectionInfo(self, request_iterator, context):
        async for response in super().ServerReflectionInfo(request_iterator, context):
            yield self._documented(response)


def enable_reflection(server: grpc.aio.Server, service_names: Iterable[str], others: Iterable[FileDescriptor]) -> None:
    """Serve reflection for ``service_names`` (the reflection service is added to
    them): the binbatch API with its comments, and the compiled files ``others``
    (those of the other services, e.g. health) as they are."""
    names = (*service_names, reflection.SERVICE_NAME)
    servicer = DocumentedReflectionServicer(names, source_file_descriptors(), (*others, reflection_pb2.DESCRIPTOR))
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
