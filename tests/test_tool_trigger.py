"""`auto` constrains, shown rather than assumed: a call begun on the model's behalf.

The bundled model never begins a call on its own under `auto` (0 of 20 prompts,
tests/test_tool_calls.py), so this test begins one for it: the reply's first tokens are
the call trigger, fed to the model and to the grammar of `auto`'s structural tag (the
tag vLLM is given, compiled by xgrammar, vLLM's backend) as if the model had written
them. What the model writes next, greedily, with the grammar's mask and without it, is
compared: held to the tag, a call of a declared tool whose arguments validate; free, the
same model on the same prompt writes the malformed call small models are known for.

The model runs in transformers here (its prepared weights, float32), not vLLM: vLLM's
grammar starts at the reply's first sampled token and cannot be handed the trigger.
That vLLM applies the tags at all, on a session's later chunks too, is
tests/test_tool_calls.py's.
"""

import json

import pytest

from models.chat_format import ChatFormat
from models.tools import CALL_OPEN, ToolChoice, ToolLimits, parse_tools, structural_tag
from tests.weather_tool import WEATHER

pytestmark = [pytest.mark.slow, pytest.mark.background]


@pytest.fixture(scope="module")
def model():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.cache import default_cache_dir
    from models.prepare import ModelChoice, prepare

    (llm,) = prepare([ModelChoice("llm", None, "none")], default_cache_dir(), progress=False)
    return AutoTokenizer.from_pretrained(llm.path), AutoModelForCausalLM.from_pretrained(
        llm.path, dtype=torch.float32
    ).eval()


def continue_greedily(model, tokenizer, ids: list[int], matcher=None, steps: int = 60) -> str:
    """The model's greedy continuation of ``ids``, held to ``matcher``'s grammar if given."""
    import torch
    import xgrammar as xgr

    out: list[int] = []
    bitmask = xgr.allocate_token_bitmask(1, model.config.vocab_size)
    past, step_input = None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(steps):
            result = model(input_ids=step_input, past_key_values=past, use_cache=True)
            past, logits = result.past_key_values, result.logits[0, -1].unsqueeze(0)
            if matcher is not None:
                if matcher.is_terminated():
                    break
                matcher.fill_next_token_bitmask(bitmask)
                xgr.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits.argmax())
            if matcher is not None:
                assert matcher.accept_token(token)
            if token == tokenizer.eos_token_id:
                break
            out.append(token)
            step_input = torch.tensor([[token]])
    return tokenizer.decode(out)


def call_of(text: str) -> tuple[object, object]:
    """The name and arguments of the call ``text`` writes after the trigger (None, None
    if it is not a JSON object)."""
    body = text.strip().removesuffix("</tool_call>").strip()
    try:
        call = json.loads(body)
    except ValueError:
        return None, None
    return (call.get("name"), call.get("arguments")) if isinstance(call, dict) else (None, None)


def test_a_call_begun_under_auto_is_held_to_the_schema_where_the_free_model_writes_garbage(model):
    import jsonschema
    import xgrammar as xgr

    tokenizer, lm = model
    chat = ChatFormat.from_tokenizer(tokenizer)
    tools = parse_tools([WEATHER], ToolLimits())
    question = chat.user_open() + chat.encode("What is the weather in Paris?") + chat.user_close()
    prompt = chat.system("You are a helpful assistant.", tools) + question + chat.assistant_header()
    trigger = chat.encode(CALL_OPEN)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=lm.config.vocab_size)
    tag = structural_tag(tools, ToolChoice("auto"))
    assert tag is not None
    grammar = xgr.GrammarCompiler(info).compile_structural_tag(tag)
    matcher = xgr.GrammarMatcher(grammar)
    assert all(matcher.accept_token(t) for t in trigger)  # the trigger, as if the model wrote it

    held = continue_greedily(lm, tokenizer, prompt + trigger, matcher)
    name, arguments = call_of(held)
    assert name == "get_weather", held
    jsonschema.validate(arguments, WEATHER["parameters"])
    assert matcher.is_terminated()  # the call closed, and the reply ended with it

    free = continue_greedily(lm, tokenizer, prompt + trigger)
    name, arguments = call_of(free)
    valid = name == "get_weather"
    if valid:
        try:
            jsonschema.validate(arguments, WEATHER["parameters"])
        except jsonschema.ValidationError:
            valid = False
    assert not valid, free  # (measured: the name "Paris", and the schema itself as arguments)
