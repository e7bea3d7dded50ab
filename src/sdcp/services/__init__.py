"""SDCP roles as HTTP/2 + mTLS services: thin adapters over sdcp.protocol."""
