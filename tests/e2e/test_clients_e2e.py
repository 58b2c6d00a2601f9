"""The API as the popular client libraries use it, against a disaggregated `baton up`: LangChain
(structured output by JSON schema, a forced tool) and the OpenAI Agents SDK (a function tool with
tool_choice="required", over the Responses API and over chat completions)."""

from __future__ import annotations

import asyncio

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.e2e.test_openai_e2e import KEY, MODEL, WEATHER_TOOL
from tests.helpers.stack import BatonStack

pytestmark = pytest.mark.slow


class City(BaseModel):
    name: str
    country: str
    population_millions: int


def test_langchain_structured_output_and_forced_tool(disagg_stack: BatonStack) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=disagg_stack.base_url, api_key=KEY, temperature=0, max_tokens=80,  # type: ignore[arg-type]
                     max_retries=0, timeout=120)
    city = llm.with_structured_output(City, method="json_schema", strict=True).invoke("Describe Paris.")
    assert isinstance(city, City)

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return f"sunny in {city}"

    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Lund?")
    assert [call["name"] for call in message.tool_calls] == ["get_weather"]  # type: ignore[attr-defined]
    jsonschema.validate(message.tool_calls[0]["args"], WEATHER_TOOL["function"]["parameters"])  # type: ignore


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_agents_sdk_required_tool(disagg_stack: BatonStack, api: str) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # the SDK would upload traces to OpenAI otherwise
    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        seen.append(city)
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(base_url=disagg_stack.base_url, api_key=KEY, max_retries=0, timeout=120)
    model = (OpenAIResponsesModel(model=MODEL, openai_client=client) if api == "responses"
             else OpenAIChatCompletionsModel(model=MODEL, openai_client=client))
    agent = Agent(name="weather", instructions="Use the tool to answer.", tools=[get_weather], model=model,
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=80),
                  tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(Runner.run(agent, "What is the weather in Lund?", max_turns=2))
    assert len(seen) == 1 and result.final_output == f"sunny in {seen[0]}"
