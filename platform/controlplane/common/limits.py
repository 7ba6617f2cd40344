"""Bounds of the database's column types, which validated input must stay within."""

# The largest value a BigIntegerField (a signed 64-bit column) holds: a larger one overflows in the database.
MAX_BIG_INTEGER = 2**63 - 1
