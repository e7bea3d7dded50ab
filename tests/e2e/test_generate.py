"""End to end: `sdcp generate` on a local cluster of separate processes (`sdcp up --processes`) with
the bundled SmolLM2; the default, one process on the CPU, is every other module's cluster.

Rule 1 must reproduce transformers' greedy decoding token for token (SDCP 6.4), through the router,
the verifier, the drafters, the MLC and HTTP/2 + mTLS between processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from tests.e2e.homes import fresh_home
from tests.e2e.support import MAX_NEW, PROMPTS, cluster_up, sdcp, stats_when_ended
from tests.waiting import HANG_GUARD_S, wait_until

from sdcp.cluster import LocalCluster
from sdcp.models.registry import end_of_text_tokens, load_tokenizer
from sdcp.protocol.messages import Action
from sdcp.transport.client import SDCPClient

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A local cluster of a process per instance, running for the tests of this module: one of
    them is killed below, and only it starts again."""
    root = fresh_home(tmp_path_factory.mktemp("sdcp-home"))
    with cluster_up(root, "--gateway-port", "0", "--processes") as started:
        assert started.returncode == 0, started.stderr
        yield root


@pytest.mark.parametrize("prompt", PROMPTS)
def test_generate_rule1_equals_transformers_greedy(home: Path, reference: dict[str, list[int]], prompt: str) -> None:
    result = sdcp(home, "generate", "--json", "--max-new", str(MAX_NEW), prompt)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["tokens"] == reference[prompt]
    # The session that `sdcp trace` takes, and why it ended: its end-of-text token, or max-new.
    assert len(bytes.fromhex(summary["session"])) == 16
    ended_by_eos = summary["tokens"][-1] in end_of_text_tokens(load_tokenizer("smollm2"))
    assert summary["finish"] == ("eos" if ended_by_eos else "length")
    assert summary["stats"]["committed"] == len(reference[prompt])


def test_generate_streams_text_and_summary(home: Path) -> None:
    result = sdcp(home, "generate", "--max-new", "8", PROMPTS[0])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "tokens in" in result.stderr and "[length]" in result.stderr
    dashboard = LocalCluster(home).dashboard
    assert dashboard is not None and f"dashboard: {dashboard}" in result.stderr


def test_rule2_runs_end_to_end_and_at_temperature_zero_is_greedy(home: Path, reference: dict[str, list[int]]) -> None:
    # The verifier's random values depend on the session id (SDCP 6.4), so sampled output is not
    # comparable across sessions; at temperature 0, p is one-hot and rule 2 must give greedy output.
    prompt = PROMPTS[0]
    cold = sdcp(
        home, "generate", "--json", "--rule", "sampling", "--temperature", "0", "--max-new", str(MAX_NEW), prompt
    )
    assert cold.returncode == 0, cold.stderr
    assert json.loads(cold.stdout)["tokens"] == reference[prompt]
    warm = sdcp(
        home,
        "generate",
        "--json",
        "--rule",
        "sampling",
        "--temperature",
        "0.8",
        "--seed",
        "7",
        "--max-new",
        "12",
        prompt,
    )
    assert warm.returncode == 0, warm.stderr
    summary = json.loads(warm.stdout)
    assert 1 <= len(summary["tokens"]) <= 12 and summary["finish"] in ("eos", "length")


def test_generate_stop_system_and_n(home: Path) -> None:
    tokenizer: Any = load_tokenizer("smollm2")
    base = ["generate", "--json", "--max-new", "40", LONG_PROMPT]
    full = json.loads(sdcp(home, *base).stdout)
    assert full["finish"] == "length"
    # A stop text of several tokens from the middle of the greedy text ends the generation there.
    text = full["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 12]
    assert len(tokenizer(stop, add_special_tokens=False)["input_ids"]) > 1
    # Room to decode far past the stop text, so that the cancel always lands before the end (with
    # 40, a quick machine finished the session first: state finish, not fail).
    long_run = ["generate", "--json", "--max-new", "400", LONG_PROMPT]
    stopped = sdcp(home, *long_run, "--stop", stop, "--stop", "never in this text")
    assert stopped.returncode == 0, stopped.stderr
    summary = json.loads(stopped.stdout)
    assert summary["finish"] == "stop" and summary["text"] == text[: text.find(stop)]
    assert summary["tokens"] == full["tokens"][: len(summary["tokens"])] and len(summary["tokens"]) < 40
    # The session was cancelled after the stop text, not decoded on to max-new.
    stats = asyncio.run(stats_when_ended(home, bytes.fromhex(summary["session"])))
    assert stats["state"] == Action.FAIL and int(stats["committed"]) < 400  # type: ignore[call-overload]

    # A system message goes through the chat template, before the prompt.
    chat = sdcp(home, "generate", "--json", "--system", "Answer in one word.", "--max-new", "4", "What is 2+2?")
    assert chat.returncode == 0, chat.stderr
    answer = json.loads(chat.stdout)
    messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "What is 2+2?"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert answer["prompt_tokens"] == len(rendered) and answer["finish"] == "length"
    # The model ends its turn itself (the chat test of the gateway's default max_tokens): eos.
    ended = json.loads(sdcp(home, "generate", "--json", "--chat", "--max-new", "200", "Say hi.").stdout)
    assert ended["finish"] == "eos" and len(ended["tokens"]) < 200

    # -n: that many sessions of the prompt; greedy, each the same text.
    several = sdcp(home, "generate", "--json", "-n", "3", "--max-new", "8", PROMPTS[0])
    assert several.returncode == 0, several.stderr
    choices = json.loads(several.stdout)["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert len({c["session"] for c in choices}) == 3 and len({c["text"] for c in choices}) == 1


@pytest.mark.parametrize(
    "options",
    [
        ["--temperature", "0.7", "--rule", "greedy"],
        ["--top-k", "5", "--rule", "greedy"],
        ["--seed", "3"],
        ["--stop", ""],
    ],
)
def test_conflicting_generate_options_are_one_line(home: Path, options: list[str]) -> None:
    result = sdcp(home, "generate", *options, "hello")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_status_lists_the_running_instances(home: Path) -> None:
    result = sdcp(home, "status")
    assert result.returncode == 0
    for role in ("router", "verifier", "drafter", "gateway"):
        assert role in result.stdout
    # Not a terminal: a header and one plain line per instance, each URI whole on its line.
    described = json.loads(sdcp(home, "status", "--json").stdout)
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["name", "role", "uri", "admin", "pid", "state"]
    assert len(lines) == 1 + len(described["instances"])
    for line, instance in zip(lines[1:], described["instances"], strict=True):
        assert line.split() == [
            instance["name"],
            instance["role"],
            instance["uri"],
            instance["admin"] or "-",
            str(instance["pid"]),
            instance["state"],
        ]
    assert {instance["role"] for instance in described["instances"]} >= {"router", "verifier", "drafter", "gateway"}
    assert all(instance["state"] == "running" for instance in described["instances"])
    assert described["targets"] and all(isinstance(target, str) for target in described["targets"].values())


def test_version_and_help_read_as_plain_text_outside_a_terminal(home: Path) -> None:
    version = sdcp(home, "--version")
    assert version.returncode == 0 and version.stdout.strip() == sdcp(home, "version").stdout.strip()
    helped = sdcp(home, "up", "--help").stdout
    # click's plain help: no panels, and no option text cut short.
    assert "│" not in helped and "…" not in helped and "--redis" in helped


def test_a_prompt_longer_than_the_context_is_one_line(home: Path) -> None:
    result = sdcp(home, "generate", "--max-new", "9000", PROMPTS[0])
    assert result.returncode != 0 and "Traceback" not in result.stderr
    # The problem in words (SDCP Table 2's title), not its type URI.
    assert "contract invalid or not supported" in result.stderr and "context" in result.stderr
    assert "urn:" not in result.stderr and "sdcp-bad-contract" not in result.stderr


def test_a_busy_gateway_port_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        result = sdcp(tmp_path, "up", "--gateway-port", str(busy.getsockname()[1]))
    assert result.returncode != 0 and "Traceback" not in result.stderr and "busy" in result.stderr


def gateway_client(home: Path) -> openai.OpenAI:
    gateway = LocalCluster(home).gateway
    assert gateway is not None
    return openai.OpenAI(base_url=gateway, api_key="unused", timeout=120, max_retries=0)


def test_openai_streaming_completion_equals_greedy(home: Path, reference: dict[str, list[int]]) -> None:
    prompt = PROMPTS[1]
    tokenizer = load_tokenizer("smollm2")
    client = gateway_client(home)
    stream = client.completions.create(model="smollm2", prompt=prompt, max_tokens=MAX_NEW, temperature=0, stream=True)
    pieces, reasons = [], []
    for event in stream:
        pieces.append(event.choices[0].text)
        reasons.append(event.choices[0].finish_reason)
    assert len(pieces) > 1, "the completion was not streamed"
    expected = tokenizer.decode(reference[prompt], skip_special_tokens=True)
    assert "".join(pieces) == expected
    assert reasons[-1] in ("stop", "length") and all(r is None for r in reasons[:-1])


def test_openai_chat_completion_without_streaming(home: Path) -> None:
    client = gateway_client(home)
    reply = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content
    assert reply.usage is not None and 1 <= reply.usage.completion_tokens <= 8
    assert [m.id for m in client.models.list().data] == ["smollm2"]


def test_openai_bad_request_is_a_400(home: Path) -> None:
    client = gateway_client(home)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smollm2", prompt="hi", max_tokens=0)


def test_user_errors_are_one_line(tmp_path: Path) -> None:
    # tmp_path has no fetched model: the user forgot `sdcp models fetch`.
    result = sdcp(tmp_path, "status")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "no local cluster is running" in result.stderr
    missing = sdcp(tmp_path, "generate", "hello")
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert "sdcp models fetch" in missing.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text('[instance]\nuri = "https://127.0.0.1:1"\ncert = "a"\nkey = "b"\nca = "c"\ntypo = 1\n')
    config = sdcp(tmp_path, "verifier", "--config", str(bad))
    assert config.returncode != 0 and "Traceback" not in config.stderr and "instance.typo" in config.stderr


# A continuation that runs long: the model does not end it within the tokens these tests wait for.
LONG_PROMPT = "The history of the Roman Empire, from its founding to its fall, is told here in full detail."
COUNTING_PROMPT = "Count from one to two thousand: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"


def test_a_client_that_goes_away_cancels_its_session(home: Path) -> None:
    client = gateway_client(home)
    prompt = LONG_PROMPT
    stream = client.completions.create(model="smollm2", prompt=prompt, max_tokens=1500, temperature=0, stream=True)
    events = iter(stream)
    first = next(events)
    next(events)
    stream.close()  # the client disconnects after two events
    assert first.choices[0].index == 0
    stats = asyncio.run(stats_when_ended(home, bytes.fromhex(stream.response.headers["x-sdcp-sessions"])))
    assert stats["state"] == Action.FAIL and int(stats["committed"]) < 1500  # type: ignore[call-overload]


def test_a_matched_stop_string_cancels_the_session(home: Path) -> None:
    client = gateway_client(home)
    tokenizer = load_tokenizer("smollm2")
    full = client.completions.create(model="smollm2", prompt=LONG_PROMPT, max_tokens=40, temperature=0)
    text = full.choices[0].text
    # A stop string of several tokens taken from the middle of the greedy completion.
    stop = text[len(text) // 2 : len(text) // 2 + 12]
    assert len(tokenizer(stop, add_special_tokens=False)["input_ids"]) > 1
    raw = client.completions.with_raw_response.create(
        model="smollm2", prompt=LONG_PROMPT, max_tokens=1500, temperature=0, stop=stop
    )
    stopped = raw.parse()
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == text[: text.find(stop)]
    stats = asyncio.run(stats_when_ended(home, bytes.fromhex(raw.headers["x-sdcp-sessions"])))
    assert stats["state"] == Action.FAIL and int(stats["committed"]) < 1500  # type: ignore[call-overload]


async def _verifier_metric(home: Path, name: str) -> float:
    """A metric of the cluster's verifier, summed over its labels (GET metrics, as an operator)."""
    cluster = LocalCluster(home)
    cert, key, ca = cluster.client_credentials()
    verifier = next(instance.uri for instance in cluster.instances() if instance.role == "verifier")
    async with SDCPClient(verifier, cert, key, ca) as client:
        text = (await client.get_bytes("metrics")).content.decode()
    samples = [line.split()[-1] for line in text.splitlines() if line.startswith(name + "{")]
    return sum(float(sample) for sample in samples)


def test_ctrl_c_in_generate_cancels_the_session(home: Path) -> None:
    env = {**os.environ, "SDCP_HOME": str(home)}
    committed = "sdcp_verifier_tokens_committed_total"
    before = asyncio.run(_verifier_metric(home, committed))
    # Counting goes on past any stop: the generation is still running when the signal comes (a
    # prose prompt's greedy text may end with the end-of-text token within the first lines).
    command = [sys.executable, "-m", "sdcp", "generate", COUNTING_PROMPT, "--max-new", "1500", "--temperature", "0"]
    # Ctrl-C as in a terminal: a suite started as a background job (`make test &`, nohup) has SIGINT
    # ignored, which `sdcp generate` would inherit, run to its end and exit 0.
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # noqa: PLW1509 - before exec only
    )
    assert process.stdout is not None
    os.set_blocking(process.stdout.fileno(), True)
    process.stdout.read(20)  # some text has streamed
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=HANG_GUARD_S) != 0
    # The verifier ends the session (it decodes no other here) before its max_new.
    wait_until(lambda: asyncio.run(_verifier_metric(home, "sdcp:num_requests_running")) == 0, what="session ended")
    assert asyncio.run(_verifier_metric(home, committed)) - before < 1500


def test_generate_restarts_only_the_instance_that_died(home: Path, reference: dict[str, list[int]]) -> None:
    cluster = LocalCluster(home)
    before = {instance.name: instance.pid for instance in cluster.instances()}
    drafter = next(instance for instance in cluster.instances() if instance.role == "drafter")
    os.kill(drafter.pid, signal.SIGKILL)
    wait_until(lambda: not drafter.alive(), what=f"{drafter.name} gone")
    result = sdcp(home, "generate", "--max-new", str(MAX_NEW), PROMPTS[0])
    assert result.returncode == 0, result.stderr
    assert f"restarting {drafter.name}" in result.stderr
    after = {instance.name: instance.pid for instance in cluster.instances()}
    assert after[drafter.name] != before[drafter.name]
    assert {n: p for n, p in after.items() if n != drafter.name} == {
        n: p for n, p in before.items() if n != drafter.name
    }
    assert cluster.running()


def test_home_means_the_same_for_every_command(tmp_path: Path) -> None:
    # $SDCP_HOME names a home without models; --home one with them: every command uses --home.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "home").mkdir()
    home = fresh_home(tmp_path / "home")
    env = {**os.environ, "SDCP_HOME": str(elsewhere)}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "sdcp", *args, "--home", str(home)]
        return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, check=False)

    started = run("up", "--gateway-port", "0")
    try:
        assert started.returncode == 0, started.stderr
        generated = run("generate", "--max-new", "4", PROMPTS[0])
        assert generated.returncode == 0, generated.stderr
        assert run("status").returncode == 0
        assert not (elsewhere / "cluster").exists()
    finally:
        assert run("down").returncode == 0
