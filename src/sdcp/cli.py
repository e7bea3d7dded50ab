"""The `sdcp` command line."""

from __future__ import annotations

import typer

from sdcp.models.cli import models_app

app = typer.Typer(
    name="sdcp",
    help="Speculative Decoding Coordination Protocol: run roles, a local cluster, benchmarks.",
    no_args_is_help=True,
    add_completion=False,
)
app.add_typer(models_app, name="models")


@app.command()
def version() -> None:
    """Print the sdcp version."""
    from sdcp import __version__

    typer.echo(__version__)


def main() -> None:
    app()
