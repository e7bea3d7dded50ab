"""The committed prompt set of the benchmarks (sdcp/bench/prompts/<workload>.txt, in the package).

Each file holds prompts separated by a line that is exactly ``---``; lines starting with ``#`` are
comments. Prompts are tokenized with the model's chat template when it has one (SmolLM2-Instruct
answers instructions only in that form) and as plain text otherwise (the tiny test models).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CHAT_WORKLOADS",
    "CORE_WORKLOADS",
    "DEFAULT_PROMPTS_DIR",
    "WORKLOADS",
    "BenchInputError",
    "Prompt",
    "Workload",
    "load_workloads",
    "tokenize_prompt",
]

# The protocol workloads every system runs, and the chat tasks a user of the gateway sends
# (copy/edit tasks and open questions), which the systems a user compares run (runner.CHAT_SYSTEMS).
CORE_WORKLOADS = ("repetitive", "nonrepetitive", "mixed")
CHAT_WORKLOADS = ("copyedit", "open")
WORKLOADS = (*CORE_WORKLOADS, *CHAT_WORKLOADS)
DEFAULT_PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
_SEPARATOR = "---"


class BenchInputError(ValueError):
    """The benchmark's inputs (prompt files, options) are missing or malformed; the message says why."""


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: tuple[str, ...]


@dataclass(frozen=True)
class Prompt:
    """One prompt as a user writes it (the gateway takes the text) and as the model sees it."""

    text: str
    tokens: tuple[int, ...]


def parse_prompts(text: str) -> tuple[str, ...]:
    prompts: list[str] = []
    current: list[str] = []
    for line in [*text.splitlines(), _SEPARATOR]:
        if line.strip() == _SEPARATOR:
            prompt = "\n".join(current).strip()
            if prompt:
                prompts.append(prompt)
            current = []
        elif not line.startswith("#"):
            current.append(line)
    return tuple(prompts)


def load_workloads(directory: Path = DEFAULT_PROMPTS_DIR, *, per_workload: int | None = None) -> list[Workload]:
    """The workloads of ``WORKLOADS``, each limited to its first ``per_workload`` prompts when given."""
    if per_workload is not None and per_workload < 1:
        raise BenchInputError(f"per_workload must be at least 1, got {per_workload}")
    workloads = []
    for name in WORKLOADS:
        path = directory / f"{name}.txt"
        if not path.is_file():
            raise BenchInputError(f"prompt file {path} is missing")
        prompts = parse_prompts(path.read_text(encoding="utf-8"))
        if not prompts:
            raise BenchInputError(f"prompt file {path} holds no prompt")
        workloads.append(Workload(name, prompts[:per_workload] if per_workload else prompts))
    return workloads


def tokenize_prompt(tokenizer: Any, prompt: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return [int(token) for token in ids]
    return [int(token) for token in tokenizer(prompt)["input_ids"]]
