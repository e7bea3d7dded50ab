"""SDCP protocol core (sans-IO)."""
