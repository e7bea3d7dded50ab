"""The committed prompt set of the benchmarks (sdcp/bench/prompts/<workload>.txt, in the package).

Each file holds prompts separated by a line that is exactly ``---``; lines starting with ``#`` are
comments. Prompts are tokenized with the model's chat template when it has one (SmolLM2-Instruct
answers instructions only in that form) and as plain text otherwise (the tiny test models).

The workloads where history matters (``HISTORY_WORKLOADS``: one task repeated on different inputs,
and multi-turn chats) are sent one request after another to the same systems, so that what a
drafter (or the verifier's lookahead) kept of earlier answers can help. In ``multiturn.txt`` a
prompt is a conversation: a line that is exactly ``+++`` starts its next user turn, every turn is
one request, and ``{answer}`` in a later turn stands for the answer the system itself generated to
the turn before (``Conversations`` builds that turn once the answer is known).

In ``structured.txt`` each prompt's first line is the JSON schema its answer follows (on one line):
the session's constraint (structured output), with the grammar on in every system that runs it
(runner.STRUCTURED_SYSTEMS).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from sdcp.protocol.messages import Constraint

__all__ = [
    "ANSWER_PLACEHOLDER",
    "CHAT_WORKLOADS",
    "CORE_WORKLOADS",
    "DEFAULT_PROMPTS_DIR",
    "HISTORY_QUICK_PROMPTS",
    "HISTORY_WORKLOADS",
    "STRUCTURED_WORKLOAD",
    "WORKLOADS",
    "BenchInputError",
    "Conversations",
    "Prompt",
    "Workload",
    "chat_messages",
    "load_history_workloads",
    "load_structured_workload",
    "load_workloads",
    "plain_text",
    "rotated",
    "tokenize_prompt",
    "warm_up_prompts",
]

_T = TypeVar("_T")

# The protocol workloads every system runs, and the chat tasks a user of the gateway sends
# (copy/edit tasks and open questions), which the systems a user compares run (runner.CHAT_SYSTEMS).
CORE_WORKLOADS = ("repetitive", "nonrepetitive", "mixed")
CHAT_WORKLOADS = ("copyedit", "open")
WORKLOADS = (*CORE_WORKLOADS, *CHAT_WORKLOADS)
# Issue 28: workloads where history matters, sent one request after another (load_history_workloads;
# not in WORKLOADS, whose prompts other tests decode as "every benchmark prompt").
HISTORY_WORKLOADS = ("json_extraction", "sql", "code_edit", "multiturn")
# Issue 30: prompts whose answers follow a JSON schema, decoded with the grammar on.
STRUCTURED_WORKLOAD = "structured"
# Requests per history workload in `sdcp bench --quick` (the full run sends every one, 16 or more).
HISTORY_QUICK_PROMPTS = 6
DEFAULT_PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
ANSWER_PLACEHOLDER = "{answer}"
_SEPARATOR = "---"
_TURN_SEPARATOR = "+++"
# What every system answers before the measured prompts (warm_up_prompts): a request of no workload.
WARM_UP_TEXT = "Say hello."


def rotated(systems: Sequence[_T], start: int) -> list[_T]:
    """The order in which ``systems`` take a turn, the ``start``-th (modulo their number) first: the
    benchmarks rotate it from turn to turn, so that no system always runs right after the same other
    one, on a machine warmed or cooled by it."""
    start %= len(systems)
    return [*systems[start:], *systems[:start]]


class BenchInputError(ValueError):
    """The benchmark's inputs (prompt files, options) are missing or malformed; the message says why."""


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: tuple[str, ...]
    # Per prompt: whether it is a later turn of the conversation of the prompt before it (empty:
    # none is).
    continues: tuple[bool, ...] = ()
    # Per prompt: the JSON schema (its text) that the answer follows (empty: none does).
    schemas: tuple[str, ...] = ()

    def continues_at(self, index: int) -> bool:
        return 0 <= index < len(self.continues) and self.continues[index]

    def constraint_at(self, index: int) -> Constraint | None:
        if not 0 <= index < len(self.schemas):
            return None
        return Constraint(kind="json_schema", text=self.schemas[index])


@dataclass(frozen=True)
class Prompt:
    """One prompt as a user writes it (the gateway takes the text) and as the model sees it."""

    text: str
    tokens: tuple[int, ...]
    # The conversation before it: (user text, answer text) per earlier turn, oldest first.
    history: tuple[tuple[str, str], ...] = ()
    # The language its answer is decoded in (structured output), if any.
    constraint: Constraint | None = None


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


def load_history_workloads(directory: Path = DEFAULT_PROMPTS_DIR, *, per_workload: int | None = None) -> list[Workload]:
    """The workloads of ``HISTORY_WORKLOADS`` whose prompt file ``directory`` holds (a prompt
    directory written before them still runs the others), each limited to its first
    ``per_workload`` requests when given (a conversation's turns count one each)."""
    if per_workload is not None and per_workload < 1:
        raise BenchInputError(f"per_workload must be at least 1, got {per_workload}")
    workloads = []
    for name in HISTORY_WORKLOADS:
        path = directory / f"{name}.txt"
        if not path.is_file():
            continue
        prompts: list[str] = []
        continues: list[bool] = []
        for conversation in parse_prompts(path.read_text(encoding="utf-8")):
            turns = _split_turns(conversation)
            prompts.extend(turns)
            continues.extend(index > 0 for index in range(len(turns)))
        if not prompts:
            raise BenchInputError(f"prompt file {path} holds no prompt")
        if per_workload:
            prompts, continues = prompts[:per_workload], continues[:per_workload]
        workloads.append(Workload(name, tuple(prompts), tuple(continues)))
    return workloads


def load_structured_workload(
    directory: Path = DEFAULT_PROMPTS_DIR, *, per_workload: int | None = None
) -> Workload | None:
    """The structured workload, if ``directory`` holds its prompt file: each prompt with the JSON
    schema of its first line, limited to the first ``per_workload`` when given."""
    path = directory / f"{STRUCTURED_WORKLOAD}.txt"
    if not path.is_file():
        return None
    prompts, schemas = [], []
    for block in parse_prompts(path.read_text(encoding="utf-8")):
        schema, _, prompt = block.partition("\n")
        try:
            json.loads(schema)
        except ValueError as exc:
            raise BenchInputError(f"{path}: a prompt's first line is no JSON schema: {exc}") from exc
        if not prompt.strip():
            raise BenchInputError(f"{path}: a prompt has a schema and no text")
        prompts.append(prompt.strip())
        schemas.append(schema)
    if not prompts:
        raise BenchInputError(f"prompt file {path} holds no prompt")
    limit = per_workload or len(prompts)
    return Workload(STRUCTURED_WORKLOAD, tuple(prompts[:limit]), schemas=tuple(schemas[:limit]))


def _split_turns(conversation: str) -> list[str]:
    turns: list[str] = []
    current: list[str] = []
    for line in [*conversation.splitlines(), _TURN_SEPARATOR]:
        if line.strip() == _TURN_SEPARATOR:
            turn = "\n".join(current).strip()
            if turn:
                turns.append(turn)
            current = []
        else:
            current.append(line)
    return turns


def chat_messages(prompt: str, history: tuple[tuple[str, str], ...] = ()) -> list[dict[str, str]]:
    """The chat messages of a prompt after its conversation so far (what the gateway is sent)."""
    messages = []
    for user, answer in history:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return [*messages, {"role": "user", "content": prompt}]


def plain_text(prompt: str, history: tuple[tuple[str, str], ...] = ()) -> str:
    """A prompt after its conversation so far, as plain text (models without a chat template)."""
    return "\n\n".join([*(part for turn in history for part in turn), prompt])


def tokenize_prompt(tokenizer: Any, prompt: str, history: tuple[tuple[str, str], ...] = ()) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(chat_messages(prompt, history), add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return [int(token) for token in ids]
    return [int(token) for token in tokenizer(plain_text(prompt, history))["input_ids"]]


def warm_up_prompts(tokenizer: Any, structured: Sequence[Prompt]) -> tuple[Prompt, Prompt | None]:
    """The request each system answers before the measured ones, and the one the systems of the
    structured workload answer too, under its first prompt's constraint (the grammar engine's view
    of the tokenizer is built once per process), or None without that workload. Both ask
    WARM_UP_TEXT, a prompt of no workload: a cluster learns what it answers (the lookahead's and the
    drafters' history), and a measured prompt answered in the warm-up would start the measured run
    with the first tokens of its own answer already known."""
    warm = Prompt(WARM_UP_TEXT, tuple(tokenize_prompt(tokenizer, WARM_UP_TEXT)))
    if not structured:
        return warm, None
    return warm, Prompt(warm.text, warm.tokens, constraint=structured[0].constraint)


class Conversations:
    """The prompts of one workload as each system is sent them: a later turn of a conversation
    quotes, and follows, the answer that system generated to the turn before (``{answer}``)."""

    def __init__(self, tokenizer: Any, workload: Workload) -> None:
        self.tokenizer = tokenizer
        self.workload = workload
        # Per system: the last turn it was sent and the text of its answer.
        self._last: dict[str, tuple[Prompt, str]] = {}

    def prompt(self, system: str, index: int, prompt: Prompt) -> Prompt:
        """What ``system`` is sent as prompt ``index`` (``prompt``: the turn as the file has it)."""
        if not self.workload.continues_at(index):
            return prompt
        if system not in self._last:
            raise RuntimeError(f"{system} is sent a later turn of {self.workload.name} before its first")
        previous, answer = self._last[system]
        text = prompt.text.replace(ANSWER_PLACEHOLDER, answer)
        history = (*previous.history, (previous.text, answer))
        return Prompt(text, tuple(tokenize_prompt(self.tokenizer, text, history)), history)

    def answered(self, system: str, sent: Prompt, tokens: list[int]) -> None:
        """``system`` answered ``sent`` with ``tokens``."""
        answer = self.tokenizer.decode(tokens, skip_special_tokens=True).strip()
        self._last[system] = (sent, answer)
