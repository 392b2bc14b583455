"""The descriptor pool our V2 (`inference` package) protos live in.

tritonclient registers its own copy of the `inference` package in protobuf's default pool,
and two definitions of one symbol cannot share a pool. Ours live here instead, so our
server, client, benchmark and tritonclient can all be used in one process. Generated code
is pointed at this pool by proto/generate.py; the wire format does not involve pools.
"""

from __future__ import annotations

from collections.abc import Iterable

from google.protobuf import descriptor_pool
from google.protobuf.descriptor import FileDescriptor

V2_POOL = descriptor_pool.DescriptorPool()


def pool_of(files: Iterable[FileDescriptor]) -> descriptor_pool.DescriptorPool:
    """A pool holding these files and everything they import: server reflection reads a
    single pool, and our services' files now live in two."""
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(file: FileDescriptor) -> None:
        if file.name in added:
            return
        for dependency in file.dependencies:
            add(dependency)
        pool.AddSerializedFile(file.serialized_pb)
        added.add(file.name)

    for file in files:
        add(file)
    return pool
