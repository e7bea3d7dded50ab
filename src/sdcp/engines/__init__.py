"""The engines: each role's behaviour, free of any transport (docs/internals.md).

An engine owns its sessions, its model thread, its MLC use and its background work, and talks to
other roles through the small ports of ``sdcp.engines.ports``. The services (``sdcp.services``)
translate HTTP/2 + mTLS requests to engine calls; ``sdcp bench``'s in-process system wires the same
engines with an in-memory link, so both run one algorithm.
"""
