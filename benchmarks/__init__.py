"""unimem's benchmarks: each compares unimem with its peers in the same run,
prints a table and writes JSON. Run them all with ``python -m benchmarks``."""
