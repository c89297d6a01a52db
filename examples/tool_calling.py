"""An agent loop through tool calls: the model calls Python functions by name with arguments that
always parse and validate (a constraint built from the tools), the results go back as `tool`
messages, the model answers; each turn's prefix is cached. Then the same tools in a program."""

import json

from _common import run_example

import radixrt as rt


def get_weather(city: str, unit: str = "celsius") -> str:
    return json.dumps(
        {"city": city, "temperature": 21 if unit == "celsius" else 70, "sky": "clear"}
    )


def add(a: int, b: int) -> str:
    return str(a + b)


FUNCTIONS = {"get_weather": get_weather, "add": add}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 32},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]


def agent_loop(backend, question: str, max_turns: int = 3) -> str:
    """Call tools until the model answers: the first turn must call (`required`), later ones may
    (`auto`), the last one may not (`none`)."""
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    messages.append({"role": "user", "content": question})
    for turn in range(max_turns):
        choice = "required" if turn == 0 else "auto" if turn < max_turns - 1 else "none"
        reply = rt.chat(
            messages,
            tools=TOOLS,
            tool_choice=choice,
            backend=backend,
            max_new_tokens=96,
            temperature=0,
        )
        messages.append(reply.message())
        cached = reply.meta_info["cached_tokens"]
        print(f"turn {turn} ({choice}, {cached} prompt tokens cached): {reply.message()}")
        if not reply.tool_calls:
            return reply.content or ""
        for call in reply.tool_calls:
            result = FUNCTIONS[call.name](**json.loads(call.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


@rt.function
def weather_program(s, city):
    s += rt.system("You are a helpful assistant.\n\n" + rt.tools_prompt(TOOLS))
    s += rt.user(f"What is the weather in {city}?")
    s += rt.assistant(
        rt.gen("call", tools=TOOLS, tool_choice="get_weather", parallel_tool_calls=False)
    )


def main(backend) -> None:
    print("answer:", agent_loop(backend, "What is the weather in Paris?"))
    state = weather_program.run(city="Rome", backend=backend, temperature=0)
    print("program's call:", state["call"])


if __name__ == "__main__":
    run_example(main)
