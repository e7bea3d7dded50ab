"""`python -m sdcp`: the same command line as `sdcp` (the local cluster starts its instances so)."""

from sdcp.cli import main

main()
