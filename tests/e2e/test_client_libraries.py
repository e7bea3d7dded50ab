"""The client libraries agents are built on, each used as its documentation shows, against a local
SmolLM2 cluster's gateway (#39): openai's ``parse``, ``pydantic_function_tool`` and Responses API,
LangChain's ``with_structured_output`` and ``bind_tools``, instructor's JSON_SCHEMA and TOOLS modes
with nested models, and the OpenAI Agents SDK's loop with a function tool on the Responses API.
Every structured result validates; objects that name their properties allow no others.

instructor's JSON mode and LangChain's json_mode send ``json_object`` with the schema in the prompt
only: no server can hold the output to it (vLLM neither). Tried here, SmolLM2-135M wrote an object
that the 96 tokens cut short in both, so they are not run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import instructor
import openai
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool
from agents.run import RunConfig
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from sdcp.cluster import LocalCluster

pytestmark = pytest.mark.timeout(600)

MODEL = "smollm2"


class Address(BaseModel):
    street: str = Field(max_length=24)
    city: str = Field(max_length=16)


class Person(BaseModel):
    """A person and where they live."""

    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)
    home: Address


class CityOnly(TypedDict):
    """A person's name and city."""

    name: str
    city: str


def gateway_of(home: Path) -> str:
    gateway = LocalCluster(home).gateway
    assert gateway is not None
    return gateway


def client_of(home: Path) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway_of(home), api_key="unused", timeout=300, max_retries=0)


ASK_PERSON = [{"role": "user", "content": "Ada is 36 and lives at 1 Main St in London. Describe her."}]


def test_a_schema_that_does_not_close_its_objects_gets_no_other_properties(home: Path) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16}, "city": {"type": "string", "maxLength": 16}},
    }
    reply = client_of(home).chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "Describe a person called Ada from Paris: name, city, age, job, family."}
        ],
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )
    content = reply.choices[0].message.content
    assert content is not None and set(json.loads(content)) <= {"name", "city"}


def test_openai_parse_with_a_nested_model(home: Path) -> None:
    reply = client_of(home).chat.completions.parse(
        model=MODEL, messages=ASK_PERSON, response_format=Person, max_tokens=96, temperature=0
    )
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Person) and isinstance(parsed.home, Address)


@pytest.mark.parametrize("forced", ["named", "required"])
def test_openai_pydantic_function_tool_with_a_nested_model(home: Path, forced: str) -> None:
    tool = openai.pydantic_function_tool(Person)
    choice: Any = {"type": "function", "function": {"name": "Person"}} if forced == "named" else "required"
    reply = client_of(home).chat.completions.create(
        model=MODEL, messages=ASK_PERSON, tools=[tool], tool_choice=choice, max_tokens=96, temperature=0
    )
    (call,) = reply.choices[0].message.tool_calls or []
    assert call.function.name == "Person"  # type: ignore[union-attr]
    Person.model_validate_json(call.function.arguments)  # type: ignore[union-attr]


def test_the_responses_api_whole_streamed_and_continued(home: Path) -> None:
    client = client_of(home)
    first = client.responses.create(
        model=MODEL, instructions="Be brief.", input="Name a fruit.", max_output_tokens=24, temperature=0
    )
    assert first.status in ("completed", "incomplete") and first.usage is not None
    # The same turn as a chat request gives the same text (rule 1).
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}],
        max_tokens=24,
        temperature=0,
    )
    assert chat.choices[0].message.content == first.output_text
    texts: list[str] = []
    with client.responses.stream(
        model=MODEL, input="And a vegetable?", previous_response_id=first.id, max_output_tokens=24, temperature=0
    ) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                texts.append(event.delta)
        completed = stream.get_final_response()
    assert completed.output_text == "".join(texts) and completed.previous_response_id == first.id
    structured = client.responses.parse(
        model=MODEL, input=ASK_PERSON, text_format=Person, max_output_tokens=96, temperature=0
    )
    assert isinstance(structured.output_parsed, Person)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_unknown")


def chat_model(home: Path) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=gateway_of(home), api_key="unused", temperature=0, max_tokens=96)  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(home: Path, method: str) -> None:
    structured = chat_model(home).with_structured_output(Person, method=method)  # type: ignore[arg-type]
    assert isinstance(structured.invoke(ASK_PERSON[0]["content"]), Person)
    typed = chat_model(home).with_structured_output(CityOnly, method=method)  # type: ignore[arg-type]
    answer = typed.invoke("Describe a person called Ada from Paris: name, city, age, job.")
    assert isinstance(answer, dict) and set(answer) <= {"name", "city"}


def test_langchain_bind_tools_with_a_named_tool_choice(home: Path) -> None:
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    reply = chat_model(home).bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?")
    (call,) = reply.tool_calls  # type: ignore[attr-defined]
    assert call["name"] == "get_weather" and set(call["args"]) == {"city"} and not reply.invalid_tool_calls  # type: ignore[attr-defined]
    get_weather(**call["args"])


@pytest.mark.parametrize("mode", [instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS])
def test_instructor_with_a_nested_model(home: Path, mode: instructor.Mode) -> None:
    client = instructor.from_openai(client_of(home), mode=mode)
    person = client.chat.completions.create(
        model=MODEL,
        messages=ASK_PERSON,
        response_model=Person,
        max_tokens=96,
        temperature=0,
        max_retries=0,  # type: ignore[arg-type]
    )
    assert isinstance(person, Person) and isinstance(person.home, Address)


def test_an_agents_sdk_loop_with_a_function_tool_on_the_responses_api(home: Path) -> None:
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"It is sunny in {city}."

    client = openai.AsyncOpenAI(base_url=gateway_of(home), api_key="unused", timeout=300, max_retries=0)
    agent = Agent(
        name="weather",
        instructions="Answer questions about the weather. Use the tool.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        # The first turn must call the tool; after it the SDK lets the model answer in text.
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=48),
    )
    result = Runner.run_sync(
        agent, "What is the weather in Paris?", max_turns=4, run_config=RunConfig(tracing_disabled=True)
    )
    assert len(asked) == 1 and isinstance(result.final_output, str)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
