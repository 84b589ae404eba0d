"""Tools in the prompt and out of the reply (engine/tools.py), on the bundled model's tokenizer."""

from __future__ import annotations

import copy
import json

import pytest

from kvmem.engine.prompt import PromptBuilder
from kvmem.engine.tools import LiveContent, Tools, check_tool_turns, template_turns
from kvmem.errors import InvalidInputError

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TURNS = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
         {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
# A template that renders tools itself, after the system text (as Qwen 2.5's does).
NATIVE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
          "{% if loop.first and tools %}\nTOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}{% endif %}"
          "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}"
          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# One that puts them before the system text: kvmem must not use it (the head would change).
BEFORE = NATIVE.replace("{% for m in messages %}", "{% if tools %}TOOLS FIRST\n{% endif %}{% for m in messages %}")


@pytest.fixture
def tools() -> Tools:
    return Tools.from_openai([WEATHER], "auto")


def _builder(tokenizer, template: str | None = None) -> PromptBuilder:
    if template is None:
        return PromptBuilder(tokenizer)
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return PromptBuilder(tok)


def _text(pb: PromptBuilder, turns, tools) -> str:
    fact = ("f1", pb.fact_tokens("Alice lives in Paris."))
    prompt = pb.chat([fact], turns, tools)
    assert prompt.token_ids[: len(pb.head_ids)] == pb.head_ids  # the head never changes
    assert prompt.token_ids[prompt.segments[1].start: prompt.segments[1].end] == fact[1]
    return pb.tokenizer.decode(prompt.token_ids[prompt.segments[1].end:])


def test_a_template_without_tools_gets_hermes_rendering_after_the_facts(tokenizer, tools):
    pb = _builder(tokenizer)
    assert not pb.native_tools()  # SmolLM2's template ignores tools
    tail = _text(pb, TURNS, tools)
    assert '"name": "get_weather"' in tail.split("<tools>\n")[1].split("</tools>")[0]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in tail
    assert "<tool_response>\nsunny\n</tool_response>" in tail


def test_a_template_with_tools_renders_them_itself(tokenizer, tools):
    pb = _builder(tokenizer, NATIVE)
    assert pb.native_tools()
    tail = _text(pb, TURNS, tools)
    assert "TOOLS: get_weather" in tail and 'CALL get_weather {"city": "Paris"}' in tail  # arguments as an object
    assert "<tools>" not in tail and "<|im_start|>tool\nsunny" in tail


def test_a_template_that_puts_tools_in_the_head_is_not_used(tokenizer, tools):
    pb = _builder(tokenizer, BEFORE)
    assert not pb.native_tools()
    assert "TOOLS FIRST" not in _text(pb, TURNS, tools) and "<tools>" in _text(pb, TURNS, tools)


def test_parallel_results_are_one_turn():
    turns = [{"role": "user", "content": "?"},
             {"role": "assistant", "content": "", "tool_calls": [CALL, {**CALL, "id": "c2"}]},
             {"role": "tool", "content": "a", "tool_call_id": "c1"}, {"role": "tool", "content": "b", "tool_call_id": "c2"}]
    check_tool_turns(turns)
    out = template_turns(turns, native=False)
    assert [t["role"] for t in out] == ["user", "assistant", "user"]
    assert out[2]["content"].count("<tool_response>") == 2


@pytest.mark.parametrize("turns", [
    [{"role": "tool", "content": "x", "tool_call_id": "c9"}],
    [TURNS[1], TURNS[2], TURNS[2]],  # answered twice
    [{"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{"}}]}],
    [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]}],
])
def test_bad_tool_turns_name_messages(turns):
    with pytest.raises(InvalidInputError) as e:
        check_tool_turns(turns)
    assert e.value.param == "messages"


def test_parse_each_choice(tokenizer, tools):
    content, calls = tools.parse('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
                                 tokenizer)
    assert content == "Sure. " and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Rome"})]
    assert tools.parse("Just text", tokenizer) == ("Just text", ())
    # A tool the chat did not offer is not a call.
    assert tools.parse('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', tokenizer)[1] == ()
    named = Tools.from_openai([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    assert named.parse('{"city": "Oslo"}', tokenizer)[1][0].arguments == '{"city": "Oslo"}'
    required = Tools.from_openai([WEATHER], "required")
    calls = required.parse('[{"name": "get_weather", "parameters": {"city": "Oslo"}}]', tokenizer)[1]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert required.parse('[{"name": "get_weather", "param', tokenizer) == ('[{"name": "get_weather", "param', ())


def test_forced_choices_carry_vllms_schema():
    named = Tools.from_openai([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    assert named.forced and named.schema() == WEATHER["function"]["parameters"]
    one = Tools.from_openai([WEATHER], "required", parallel_tool_calls=False).schema()
    assert one["type"] == "array" and one["minItems"] == one["maxItems"] == 1
    assert not Tools.from_openai([WEATHER], "auto").forced


def test_live_content_holds_back_what_may_be_a_call(tools):
    live = LiveContent(tools)
    assert live.feed(0, "It is ") == "It is "
    assert live.feed(0, "<tool") == ""  # may be the start of <tool_call>
    assert live.feed(0, "_call>{") == ""
    assert live.rest(0, called=True) == ""
    live = LiveContent(tools)
    live.feed(0, "a <tool")
    assert live.feed(0, "box> b") == "<toolbox> b"  # it was not
    assert live.rest(0, called=False) == ""
    forced = LiveContent(Tools.from_openai([WEATHER], "required"))
    assert forced.feed(0, "[{") == "" and forced.rest(0, called=False) == "[{"


@pytest.mark.parametrize("tools,choice,param", [
    ("nope", None, "tools"), ([{"type": "code_interpreter"}], None, "tools"), ([WEATHER, WEATHER], None, "tools"),
    ([WEATHER], "sometimes", "tool_choice"), ([WEATHER], {"type": "function", "function": {"name": "x"}}, "tool_choice"),
    (None, "required", "tool_choice"), ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None, "tools"),
])
def test_bad_tools_name_their_field(tools, choice, param):
    with pytest.raises(InvalidInputError) as e:
        Tools.from_openai(tools, choice)
    assert e.value.param == param


def test_an_unknown_parser_is_a_configuration_error():
    from kvmem.config import ConfigError

    with pytest.raises(ConfigError, match="tool_call_parser 'nope'"):
        Tools.from_openai([WEATHER], "auto", parser="nope")
    assert Tools.from_openai([WEATHER], "auto", parser="llama3_json").parser == "llama3_json"


@pytest.mark.parametrize("tools,turns", [
    ([{"type": "function", "function": {"name": "f", "description": "a\ud800"}}], []),
    ([WEATHER], [{"role": "assistant", "content": "", "tool_calls": [{**CALL, "id": "c\ud800"}]}]),
    ([WEATHER], [TURNS[1], {"role": "tool", "content": "sunny \udfff", "tool_call_id": "c1"}]),
], ids=["description", "call-id", "tool-content"])
def test_a_lone_surrogate_in_a_tool_field_is_bad_input(tools, turns):
    """It would reach the tokenizer and fail there (a 500 before this check)."""
    with pytest.raises(InvalidInputError):
        Tools.from_openai(tools, "auto")
        check_tool_turns(turns)


def test_parallel_false_keeps_one_auto_call(tokenizer):
    two = ('<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>'
           '<tool_call>{"name": "get_weather", "arguments": {"city": "B"}}</tool_call>')
    assert len(Tools.from_openai([WEATHER], "auto").parse(two, tokenizer)[1]) == 2
    assert len(Tools.from_openai([WEATHER], "auto", parallel_tool_calls=False).parse(two, tokenizer)[1]) == 1


def test_a_template_that_refuses_is_bad_input(tokenizer):
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = NATIVE.replace("{% for m in messages %}", "{% for m in messages %}{% if m.role == 'tool' %}"
                                          "{{ raise_exception('no tool role') }}{% endif %}")
    pb = PromptBuilder(strict)
    with pytest.raises(InvalidInputError) as e:
        pb.chat([], TURNS, Tools.from_openai([WEATHER], "auto"))
    assert e.value.param == "messages" and "no tool role" in str(e.value)
