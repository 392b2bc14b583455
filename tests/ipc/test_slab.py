"""The slab's header (what the worker has read from a link) and where tensors go."""

from __future__ import annotations

from service.ipc.slab import HEADER_BYTES, Region, RegionAllocator, Slab


def test_the_workers_read_counts_reach_the_front_end() -> None:
    front = Slab.create(1 << 16, "attention-test")
    worker = Slab.attach(front.fd)  # as the worker maps the descriptor it was sent
    assert front.read_counts() == (0, 0)
    worker.note_read(7, 7 * 2048)
    assert front.read_counts() == (7, 14336)
    worker.note_read(2**40 + 1, 2**62)  # counters are 64 bits wide
    assert front.read_counts() == (2**40 + 1, 2**62)
    assert front.capacity == 1 << 16
    assert front.size == HEADER_BYTES + (1 << 16)


def test_tensors_never_overlap_the_header() -> None:
    slab = Slab.create(1 << 16, "attention-test")
    allocator = RegionAllocator(slab.capacity)
    regions = [allocator.alloc(1000) for _ in range(3)]
    assert min(region.offset for region in regions) == HEADER_BYTES
    slab.note_read(5, 500)
    for region in regions:
        slab.array(region.offset, (region.nbytes,), "u1")[:] = 255
    assert slab.read_counts() == (5, 500)
    slab.release_pages(Region(HEADER_BYTES, slab.capacity))  # the idle trim keeps the header
    assert slab.read_counts() == (5, 500)


def test_free_blocks_are_the_coalesced_gaps_between_held_regions() -> None:
    allocator = RegionAllocator(1 << 16)
    a, b, c, d = (allocator.alloc(1024) for _ in range(4))
    allocator.free(b)
    allocator.free(c)  # coalesces with b
    assert allocator.free_blocks() == [
        Region(b.offset, 2048),
        Region(d.offset + 1024, (1 << 16) - 4096),
    ]
    allocator.free(a)
    allocator.free(d)
    assert allocator.free_blocks() == [Region(HEADER_BYTES, 1 << 16)]
