"""Who holds a block: its ``client`` in its allocator's snapshot (the
framework whose entry point handed it out: unimem._core.CLIENTS)."""


def client_of(allocator, ptr):
    """The snapshot's client of the block at ``ptr`` (None: a free block)."""
    for segment in allocator.snapshot():
        for block in segment["blocks"]:
            if block["address"] == ptr:
                return block["client"]
    raise AssertionError(f"{ptr:#x} is no block of the allocator")
