"""sdcp: reference implementation of the Speculative Decoding Coordination Protocol."""

__version__ = "0.1.0"
