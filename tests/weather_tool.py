"""The function tool the tool tests declare, in the Realtime API's shape (tests/e2e/
tool_client.py, which imports nothing of the project, writes its own)."""

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather now in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
