"""Pure placement policies: stdlib and our own types only (no I/O, clock or randomness)."""
