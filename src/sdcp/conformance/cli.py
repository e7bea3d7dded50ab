"""`sdcp conformance verifier|drafter|router URL`: run the kit against a remote instance."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import typer

from sdcp.conformance.report import Report
from sdcp.conformance.wire import Identity
from sdcp.terminal import help_markup_mode

conformance_app = typer.Typer(
    rich_markup_mode=help_markup_mode(),
    help="Check a verifier, drafter or router over the wire against the draft; exit 0 only if all pass.",
    no_args_is_help=True,
)

_CA = typer.Option(..., exists=True, dir_okay=False, help="The CA that issued every certificate.")


def _identity(cert: Path | None, key: Path | None, role: str) -> Identity:
    if cert is None or key is None:
        raise typer.BadParameter(f"give --{role}-cert and --{role}-key: the kit plays the {role}")
    try:
        return Identity.from_files(cert, key)
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from exc


def _run(checks: Callable[[Report], Coroutine[Any, Any, Report]]) -> None:
    report = asyncio.run(checks(Report(echo=print)))
    failed = report.failed()
    print(f"{len(report.results) - len(failed)} of {len(report.results)} checks passed")
    raise typer.Exit(0 if report.passed else 1)


def _file_option(role: str, what: str) -> Any:
    return typer.Option(None, f"--{role}-{what}", exists=True, dir_okay=False, help=f"The played {role}'s {what}.")


_ROUTER_CERT, _ROUTER_KEY = _file_option("router", "cert"), _file_option("router", "key")
_DRAFTER_CERT, _DRAFTER_KEY = _file_option("drafter", "cert"), _file_option("drafter", "key")
_VERIFIER_CERT, _VERIFIER_KEY = _file_option("verifier", "cert"), _file_option("verifier", "key")
_DRAFTER2_CERT, _DRAFTER2_KEY = _file_option("drafter2", "cert"), _file_option("drafter2", "key")
_FRONT_END_CERT, _FRONT_END_KEY = _file_option("front-end", "cert"), _file_option("front-end", "key")
_TARGET = typer.Option(..., help="The target digest, hex (`sdcp models digest`).")
_TOKENIZER = typer.Option(..., help="The tokenizer digest, hex.")
_MLC = typer.Option(None, help="The MLC node that holds draft rows (rule-2 checks).")
_VOCAB = typer.Option(None, help="The target's vocabulary size (rule-2 checks).")


def _digests(target: str, tokenizer: str) -> tuple[bytes, bytes]:
    try:
        return bytes.fromhex(target), bytes.fromhex(tokenizer)
    except ValueError as exc:
        raise typer.BadParameter(f"digests are hex: {exc}") from exc


@conformance_app.command("verifier")
def verifier(
    url: str = typer.Argument(..., help="The verifier's base URI."),
    ca: Path = _CA,
    router_cert: Path | None = _ROUTER_CERT,
    router_key: Path | None = _ROUTER_KEY,
    drafter_cert: Path | None = _DRAFTER_CERT,
    drafter_key: Path | None = _DRAFTER_KEY,
    target: str = _TARGET,
    tokenizer: str = _TOKENIZER,
    mlc: str | None = _MLC,
    vocab: int | None = _VOCAB,
) -> None:
    """Play the router and the drafter of sessions at a verifier (SDCP 4, 5, 6.1-6.7)."""
    from sdcp.conformance.verifier import VerifierUnderTest, check_verifier

    digests = _digests(target, tokenizer)
    under_test = VerifierUnderTest(
        url=url,
        ca=ca,
        router=_identity(router_cert, router_key, "router"),
        drafter=_identity(drafter_cert, drafter_key, "drafter"),
        target=digests[0],
        tokenizer=digests[1],
        mlc=mlc,
        vocab=vocab,
    )
    _run(lambda report: check_verifier(under_test, report))


@conformance_app.command("drafter")
def drafter(
    url: str = typer.Argument(..., help="The drafter's base URI."),
    ca: Path = _CA,
    router_cert: Path | None = _ROUTER_CERT,
    router_key: Path | None = _ROUTER_KEY,
    verifier_cert: Path | None = _VERIFIER_CERT,
    verifier_key: Path | None = _VERIFIER_KEY,
    target: str = _TARGET,
    tokenizer: str = _TOKENIZER,
    mlc: str | None = _MLC,
    vocab: int | None = _VOCAB,
) -> None:
    """Play a drafter's router and, listening on its certificate's URI, its verifier (SDCP 6.2-6.5, 6.9)."""
    from sdcp.conformance.drafter import DrafterUnderTest, check_drafter

    digests = _digests(target, tokenizer)
    under_test = DrafterUnderTest(
        url=url,
        ca=ca,
        router=_identity(router_cert, router_key, "router"),
        verifier=_identity(verifier_cert, verifier_key, "verifier"),
        target=digests[0],
        tokenizer=digests[1],
        mlc=mlc,
        vocab=vocab,
    )
    _run(lambda report: check_drafter(under_test, report))


@conformance_app.command("router")
def router(
    url: str = typer.Argument(..., help="The router's base URI."),
    ca: Path = _CA,
    front_end_cert: Path | None = _FRONT_END_CERT,
    front_end_key: Path | None = _FRONT_END_KEY,
    verifier_cert: Path | None = _VERIFIER_CERT,
    verifier_key: Path | None = _VERIFIER_KEY,
    drafter_cert: Path | None = _DRAFTER_CERT,
    drafter_key: Path | None = _DRAFTER_KEY,
    drafter2_cert: Path | None = _DRAFTER2_CERT,
    drafter2_key: Path | None = _DRAFTER2_KEY,
    target: str = _TARGET,
    tokenizer: str = _TOKENIZER,
) -> None:
    """Play a router's verifier and two drafters, listening on their certificates' URIs, and a
    front end that asks for a session (SDCP 5.2, 6.1, 6.5.2)."""
    from sdcp.conformance.router import RouterUnderTest, check_router

    digests = _digests(target, tokenizer)
    under_test = RouterUnderTest(
        url=url,
        ca=ca,
        front_end=_identity(front_end_cert, front_end_key, "front-end"),
        verifier=_identity(verifier_cert, verifier_key, "verifier"),
        drafters=(_identity(drafter_cert, drafter_key, "drafter"), _identity(drafter2_cert, drafter2_key, "drafter2")),
        target=digests[0],
        tokenizer=digests[1],
    )
    _run(lambda report: check_router(under_test, report))
