"""The SDCP conformance kit: drives a remote verifier, drafter or router over the wire.

Written from the draft alone and kept apart from `sdcp.protocol` (a test enforces that no module
here imports it): the kit has its own CBOR encoder and decoder (`cbor`), its own contract digest,
prefix digest chain, HMAC-SHA-256 and verifier randomness (`formulas`), so that a misreading of
the draft shared with the implementation cannot make a check pass. Each check cites the section it
tests and reports PASS or FAIL with its evidence (`report`); `sdcp conformance ROLE URL` runs them.
"""
