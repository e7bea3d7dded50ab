"""Issue 28's workloads where history matters, and who produced the committed tokens (unit level)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sdcp.bench.report import markdown, summarise, token_roles
from sdcp.bench.runner import BenchConfig, BenchData, ConcurrencyLevel, Measurement
from sdcp.bench.systems import RunResult
from sdcp.bench.workloads import (
    ANSWER_PLACEHOLDER,
    HISTORY_QUICK_PROMPTS,
    HISTORY_WORKLOADS,
    WORKLOADS,
    Conversations,
    Prompt,
    Workload,
    chat_messages,
    load_history_workloads,
    load_workloads,
    tokenize_prompt,
)


class _Words:
    """A tokenizer of words without a chat template: ids index a growing vocabulary."""

    def __init__(self) -> None:
        self.vocabulary: list[str] = []

    def __call__(self, text: str) -> dict[str, list[int]]:
        ids = []
        for word in text.split():
            if word not in self.vocabulary:
                self.vocabulary.append(word)
            ids.append(self.vocabulary.index(word))
        return {"input_ids": ids}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(self.vocabulary[i] for i in ids)


def test_the_history_workloads_ship_sixteen_requests_or_more_each() -> None:
    workloads = {w.name: w for w in load_history_workloads()}
    assert list(workloads) == list(HISTORY_WORKLOADS)
    assert all(len(w.prompts) >= 16 for w in workloads.values())
    assert all(len(set(w.prompts)) == len(w.prompts) for w in workloads.values())  # different inputs
    multiturn = workloads["multiturn"]
    assert len(multiturn.continues) == len(multiturn.prompts) and not multiturn.continues[0]
    # Every later turn quotes the answer before it; no first turn has one to quote.
    for prompt, continues in zip(multiturn.prompts, multiturn.continues, strict=True):
        assert (ANSWER_PLACEHOLDER in prompt) is continues
    assert sum(multiturn.continues) >= 8
    # The protocol and chat workloads, which other tests decode as every benchmark prompt, are as before.
    assert [w.name for w in load_workloads()] == list(WORKLOADS)
    assert not set(HISTORY_WORKLOADS) & set(WORKLOADS)


def test_quick_and_per_workload_limit_the_history_requests(tmp_path: Path) -> None:
    assert BenchConfig(out=tmp_path).effective_history_per_workload is None
    assert BenchConfig(out=tmp_path, quick=True).effective_history_per_workload == HISTORY_QUICK_PROMPTS
    assert BenchConfig(out=tmp_path, quick=True).effective_per_workload == 2  # the other workloads: as before
    assert BenchConfig(out=tmp_path, quick=True, per_workload=3).effective_history_per_workload == 3
    limited = {w.name: w for w in load_history_workloads(per_workload=HISTORY_QUICK_PROMPTS)}
    assert all(len(w.prompts) == HISTORY_QUICK_PROMPTS for w in limited.values())
    assert limited["multiturn"].continues == (False, True) * (HISTORY_QUICK_PROMPTS // 2)
    # A prompt directory without the history files still runs the other workloads.
    assert load_history_workloads(tmp_path) == []


def test_a_later_turn_quotes_and_follows_the_answer_the_system_generated(tmp_path: Path) -> None:
    (tmp_path / "multiturn.txt").write_text(
        "# a comment\nWrite a note.\n+++\nYou wrote: {answer}\nShorten it.\n---\nName a colour.\n", encoding="utf-8"
    )
    (workload,) = load_history_workloads(tmp_path)
    assert workload == Workload(
        "multiturn", ("Write a note.", "You wrote: {answer}\nShorten it.", "Name a colour."), (False, True, False)
    )
    tokenizer = _Words()
    files = [Prompt(text, tuple(tokenize_prompt(tokenizer, text))) for text in workload.prompts]
    conversations = Conversations(tokenizer, workload)
    answers = {"a": "Dear all, come over.", "b": "Hello there."}
    for system, answer in answers.items():
        first = conversations.prompt(system, 0, files[0])
        assert first == files[0]
        conversations.answered(system, first, tokenizer(answer)["input_ids"])
    for system, answer in answers.items():
        second = conversations.prompt(system, 1, files[1])
        assert second.text == f"You wrote: {answer}\nShorten it."
        assert second.history == (("Write a note.", answer),)
        assert tokenizer.decode(list(second.tokens)) == " ".join(["Write a note.", answer, second.text]).replace(
            "\n", " "
        )
        assert chat_messages(second.text, second.history) == [
            {"role": "user", "content": "Write a note."},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": second.text},
        ]
        conversations.answered(system, second, tokenizer("Short.")["input_ids"])
    # A new conversation starts from its own text again.
    assert conversations.prompt("a", 2, files[2]) == files[2]


def _run(tokens: int, **stats: Any) -> RunResult:
    return RunResult(tokens=list(range(tokens)), seconds=1.0, **stats)


def test_token_roles_split_the_committed_tokens() -> None:
    # 3 proposal rounds accepting 4 + 0 + 2 drafts (+1 verifier token each), then 3 self-decoded.
    assert token_roles(_run(12, rounds=3, accepted=6, proposed=12, self_decoded=3)) == {
        "drafters": 6,
        "self_decoding": 3,
        "verifier_extra": 3,
    }
    # The last round reached max_new: 4 drafts accepted, 2 of them committed.
    assert token_roles(_run(2, rounds=1, accepted=4, proposed=4)) == {
        "drafters": 2,
        "self_decoding": 0,
        "verifier_extra": 0,
    }
    assert token_roles(_run(5, self_decoded=5)) == {"drafters": 0, "self_decoding": 5, "verifier_extra": 0}


def test_the_report_gives_acceptance_and_roles_per_workload() -> None:
    def sdcp(tokens: int, accepted: int, rounds: int, self_decoded: int, by_position: list[int]) -> RunResult:
        return _run(
            tokens,
            rounds=rounds,
            accepted=accepted,
            proposed=sum([rounds] * 4),
            self_decoded=self_decoded,
            accepted_by_position=by_position,
            proposed_by_position=[rounds] * 4,
        )

    measurements = [
        # Two sql requests: 2 rounds of 4 drafts each, then 4 rounds of 4.
        Measurement("sdcp_default", "sql", 0, 0, sdcp(10, 5, 2, 3, [2, 2, 1, 0])),
        Measurement("sdcp_default", "sql", 1, 0, sdcp(20, 12, 4, 4, [4, 3, 3, 2])),
        Measurement("hf_target", "sql", 0, 0, _run(10)),
        Measurement("hf_target", "sql", 1, 0, RunResult(list(range(20)), 2.0)),
        # 8 self-decoded rounds in 2 passes: guesses scored with them were right.
        Measurement("sdcp_default", "open", 0, 0, _run(8, self_decoded=8, self_passes=2)),
        Measurement("hf_target", "open", 0, 0, _run(8)),
    ]
    data = BenchData(
        config=BenchConfig(out=Path("unused")),
        workloads=[Workload("open", ("p",)), Workload("sql", ("a", "b"))],
        measurements=measurements,
        concurrency=[ConcurrencyLevel(1, 10, 1.0)],
        systems=["hf_target", "sdcp_default"],
        seconds=1.0,
    )
    summary = summarise(data)
    sql = summary["systems"]["sdcp_default"]["sql"]
    assert sql["mean_accepted_length"] == round(17 / 6, 3)
    assert sql["acceptance_by_position"] == [1.0, round(5 / 6, 3), round(4 / 6, 3), round(2 / 6, 3)]
    assert sql["tokens_by_role"] == {"drafters": 17, "self_decoding": 7, "verifier_extra": 6}
    assert sql["token_share_by_role"] == {
        "drafters": round(17 / 30, 3),
        "self_decoding": round(7 / 30, 3),
        "verifier_extra": 0.2,
    }
    assert summary["systems"]["sdcp_default"]["open"]["token_share_by_role"] == {
        "drafters": 0.0,
        "self_decoding": 1.0,
        "verifier_extra": 0.0,
    }
    opened = summary["systems"]["sdcp_default"]["open"]
    assert (opened["tokens_per_target_pass"], opened["rounds_per_100_tokens"], opened["self_decoded_share"]) == (
        4.0,
        100.0,
        1.0,
    )
    # A proposal round is a pass: 6 proposal rounds and 7 self-decoded rounds (no pass counted) for 30 tokens.
    assert (sql["tokens_per_target_pass"], sql["rounds_per_100_tokens"]) == (5.0, round(100 * 13 / 30, 2))
    assert "token_share_by_role" not in summary["systems"]["hf_target"]["sql"]
    # The history workloads stay out of "all" and of the goals' "every workload".
    assert summary["systems"]["sdcp_default"]["all"]["tokens"] == 8
    assert list(summary["default_vs_target"]) == ["open"]
    history = summary["history"]
    assert history["workloads"] == ["sql"] and history["prompts"] == {"sql": 2}
    assert history["default_vs_target"]["sql"] == 1.5  # 30 tokens in 2 s against 30 in 3 s
    assert history["acceptance_by_request"]["sql"] == {"sdcp_default": [round(5 / 8, 3), 0.75]}
    report = markdown(summary)
    assert "| sql | sdcp_default | 15.0 | 2.833 | 1.00 0.83 0.67 0.33 | 0.567 | 0.233 | 0.200 |" in report
    assert "| sql | 1.50 | - | - | 0.62 0.75 |" in report
