"""The parts of :class:`unimem._memory_api.MemoryAPI`, one concern a module:
what the functions take (:mod:`.arguments`), the device type they are bound to
(:mod:`.device_type`), allocation, configuration, statistics and
snapshots/history. ``unimem._memory_api`` assembles the class."""
