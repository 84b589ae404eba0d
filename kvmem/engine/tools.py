"""Tool calling: OpenAI's `tools` / `tool_choice` checked, rendered into the prompt, read back out.

Rendering keeps the prompt's layout [head][facts][tail]: the tool definitions and tool turns
always land in the tail, so KV mode and text mode read the same tokens and the head (whose KV is
shared by every chat) never changes. A chat template that renders tools itself, after the
system message's start, is used as it is; one that ignores them (SmolLM2's) or puts them before
the system text gets kvmem's rendering instead: the definitions appended to the system message
after the facts, calls and results in the Hermes format (`<tool_call>` / `<tool_response>`),
which vLLM's "hermes" parser reads.

Replies are read back with vLLM's own pieces: its tool parsers (`tool_call_parser`, like
`vllm serve --tool-call-parser`) for tool_choice "auto", and for "required" or a named function
the JSON schema vLLM's server would constrain the reply with (structured outputs), so the reply
always parses, even from a 135M model.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

from kvmem.config import ConfigError
from kvmem.errors import InvalidInputError
from kvmem.facts.text import check_unicode
from kvmem.results import ToolCall

CHOICES = ("none", "auto", "required")
_MSG = "messages"


@dataclass(frozen=True)
class Tools:
    """A chat's tools. `choice`: "none", "auto", "required", or "function" with `function` named."""

    specs: tuple[Mapping[str, Any], ...]  # OpenAI tool definitions: {type: function, function: {name, ...}}
    choice: str = "auto"
    function: str | None = None
    parallel: bool = True
    parser: str = "hermes"

    @classmethod
    def from_openai(cls, tools, tool_choice=None, parallel_tool_calls=None, parser: str = "hermes") -> "Tools | None":
        """OpenAI's fields, checked (errors name the field); None when no tools are given."""
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise InvalidInputError("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
        if not tools:
            if tool_choice not in (None, "none"):
                raise InvalidInputError("tool_choice needs tools", param="tool_choice")
            return None
        specs = tuple(_check_spec(t, i) for i, t in enumerate(_as_list(tools)))
        names = [s["function"]["name"] for s in specs]
        if len(set(names)) != len(names):
            raise InvalidInputError(f"tool names must be unique, got {names}", param="tools")
        choice, function = _check_choice(tool_choice, names)
        _check_parser(parser)
        return cls(specs, choice, function, parallel_tool_calls is not False, parser)

    @property
    def forced(self) -> bool:
        """The reply must be tool calls: constrained by a schema, read without a parser."""
        return self.choice in ("required", "function")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s["function"]["name"] for s in self.specs)

    def schema(self) -> dict:
        """The JSON schema vLLM's server constrains a forced reply with: a named function's
        parameters, or for "required" a list of {name, parameters} (one item if not parallel)."""
        from vllm.exceptions import VLLMClientError
        from vllm.tool_parsers.utils import get_json_schema_from_tools

        request = self._vllm_request()
        try:
            return get_json_schema_from_tools(request.tool_choice, request.tools, request.parallel_tool_calls)
        except (VLLMClientError, ValueError) as e:  # e.g. "$defs" that is not an object
            raise InvalidInputError(f"the tools' parameters cannot make a schema: {e}", param="tools") from None

    def parse(self, text: str, tokenizer) -> tuple[str | None, tuple[ToolCall, ...]]:
        """A reply -> (content, tool calls); a reply that names no tool is all content."""
        if self.choice == "none":
            return text, ()
        if self.choice == "function":
            return None, (ToolCall(_call_id(), self.function, text.strip()),)
        if self.choice == "required":
            return _parse_required(text)
        return self._parse_auto(text, tokenizer)

    def _parse_auto(self, text: str, tokenizer) -> tuple[str | None, tuple[ToolCall, ...]]:
        from vllm.tool_parsers import ToolParserManager

        parser = ToolParserManager.get_tool_parser(self.parser)(tokenizer)
        found = parser.extract_tool_calls(text, self._vllm_request())
        if not found.tools_called:
            return text, ()
        calls = tuple(ToolCall(c.id or _call_id(), c.function.name, c.function.arguments) for c in found.tool_calls)
        unknown = [c.name for c in calls if c.name not in self.names]
        if unknown:  # the model named a tool it was not given: its text stays content
            return text, ()
        return (found.content or None), calls if self.parallel else calls[:1]  # as vLLM's server trims them

    def _vllm_request(self):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        choice = {"type": "function", "function": {"name": self.function}} if self.choice == "function" else self.choice
        return ChatCompletionRequest(model="kvmem", messages=[{"role": "user", "content": ""}],
                                     tools=[dict(s) for s in self.specs], tool_choice=choice,
                                     parallel_tool_calls=self.parallel)

    # -- rendering -----------------------------------------------------------------------------

    def system_block(self) -> str:
        """kvmem's rendering of the definitions, appended to the system message after the facts."""
        lines = "\n".join(json.dumps(dict(s), ensure_ascii=False) for s in self.specs)
        return ("\n\n# Tools\n\nYou can call these functions, given as JSON within <tools></tools>:\n"
                f"<tools>\n{lines}\n</tools>\n\nTo call one, reply with a JSON object naming it and its "
                'arguments within <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function name>, '
                '"arguments": <arguments as a JSON object>}\n</tool_call>')


def _as_list(tools) -> list:
    if not isinstance(tools, (list, tuple)):
        raise InvalidInputError("tools must be a list of tool definitions", param="tools")
    return list(tools)


def _check_spec(tool, i: int) -> dict:
    """One definition, as vLLM's request class reads it (type "function" only)."""
    from pydantic import ValidationError
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam

    if not isinstance(tool, Mapping) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, Mapping) else type(tool).__name__
        raise InvalidInputError(f"tools[{i}]: only tools of type 'function' are supported, got {kind!r}",
                                param="tools")
    try:
        spec = ChatCompletionToolsParam.model_validate(tool).model_dump(exclude_none=True)
    except ValidationError as e:
        raise InvalidInputError(f"tools[{i}] is not a function definition: {e.errors()[0]['msg']}",
                                param="tools") from None
    # Every text of a definition reaches the tokenizer, which fails on a lone surrogate: a 400 here.
    check_unicode(f"tools[{i}]", json.dumps(spec, ensure_ascii=False), param="tools")
    params = spec["function"].get("parameters")
    if params is not None and not isinstance(params, dict):
        raise InvalidInputError(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
    if not spec["function"]["name"].strip():
        raise InvalidInputError(f"tools[{i}].function.name must not be empty", param="tools")
    return spec


def _check_parser(name: str) -> None:
    from vllm.tool_parsers import ToolParserManager

    if name not in ToolParserManager.list_registered():
        raise ConfigError(f"prompt.tool_call_parser {name!r} is not one of vLLM's tool parsers: "
                          f"{', '.join(ToolParserManager.list_registered())}")


def _check_choice(tool_choice, names: list[str]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise InvalidInputError(f"tool_choice must be one of {CHOICES} or a named function, got {tool_choice!r}",
                                    param="tool_choice")
        return tool_choice, None
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, Mapping) else None
    if not isinstance(tool_choice, Mapping) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise InvalidInputError('tool_choice must be a string or {"type": "function", "function": {"name": ...}}',
                                param="tool_choice")
    if name not in names:
        raise InvalidInputError(f"tool_choice names {name!r}, which is not among the tools {names}",
                                param="tool_choice")
    return "function", name


def _parse_required(text: str) -> tuple[str | None, tuple[ToolCall, ...]]:
    """A reply constrained to [{name, parameters}, ...] (cut short by max_tokens: content)."""
    try:
        items = json.loads(text)
        calls = tuple(ToolCall(_call_id(), it["name"], json.dumps(it["parameters"], ensure_ascii=False))
                      for it in items)
    except (ValueError, TypeError, KeyError):
        return text, ()
    return None, calls


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# -- tool turns -------------------------------------------------------------------------------------


def check_tool_turns(messages: list[dict]) -> None:
    """Assistant tool calls well formed, and each tool message answering a call made before it."""
    open_calls: set[str] = set()
    for i, m in enumerate(messages):
        if m.get("tool_calls") and m.get("role") != "assistant":  # the chat template would render them
            raise InvalidInputError(f"message {i}: only assistant messages carry tool_calls, not "
                                    f"{m.get('role')!r} ones", param=_MSG)
        if m.get("role") == "assistant" and m.get("tool_calls"):
            open_calls |= {_check_call(c, i, j) for j, c in enumerate(m["tool_calls"])}
        elif m.get("role") == "tool":
            call = m.get("tool_call_id")
            if call not in open_calls:
                raise InvalidInputError(f"message {i}: tool message answers tool_call_id {call!r}, which no earlier "
                                        "assistant message called (or was answered already)", param=_MSG)
            open_calls.discard(call)
            if not isinstance(m.get("content"), str):
                raise InvalidInputError(f"message {i}: a tool message's content must be text", param=_MSG)
            check_unicode(f"message {i} content", m["content"], param=_MSG)


def _check_call(call, i: int, j: int) -> str:
    where = f"message {i}: tool_calls[{j}]"
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(call.get("id"), str) or not isinstance(function.get("name"), str):
        raise InvalidInputError(f"{where} must be {{id, type: function, function: {{name, arguments}}}}", param=_MSG)
    try:
        json.loads(function.get("arguments") or "{}")
    except (ValueError, TypeError):
        raise InvalidInputError(f"{where}.function.arguments must be a JSON string", param=_MSG) from None
    for text in (call["id"], function["name"], function.get("arguments") or ""):
        check_unicode(where, text, param=_MSG)
    return call["id"]


def template_turns(messages: list[dict], native: bool) -> list[dict]:
    """Turns as the chat template gets them: as OpenAI has them (arguments as objects, the HF
    convention) for a template that renders tools; else calls and results in Hermes text."""
    out: list[dict] = []
    for m in messages:
        calls = m.get("tool_calls") or ()
        if native:
            turn = {k: v for k, v in m.items() if k in ("role", "content", "name", "tool_call_id")}
            if calls:
                turn["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _args(c)}} for c in calls]
            out.append(turn)
        elif m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_results"):
                out[-1]["content"] += "\n" + text  # results of parallel calls: one turn
            else:
                out.append({"role": "user", "content": text, "_results": True})
        else:
            shown = [json.dumps({"name": c["function"]["name"], "arguments": _args(c)}, ensure_ascii=False) for c in calls]
            content = "\n".join([m.get("content") or "", *(f"<tool_call>\n{s}\n</tool_call>" for s in shown)]).strip()
            out.append({**{k: v for k, v in m.items() if k in ("role", "name")}, "content": content})
    return [{k: v for k, v in t.items() if k != "_results"} for t in out]


def _args(call: Mapping) -> Any:
    return json.loads(call["function"].get("arguments") or "{}")


# -- streaming ------------------------------------------------------------------------------------


class LiveContent:
    """What of a streamed reply may be sent as content while it is generated, per choice.

    With tool_choice "auto" text goes out as it comes until the parser's start tag (or what may
    be its beginning) shows up; forced replies are calls from the first token and send nothing
    live. The rest is sent when the reply is read (`rest`): the held-back text, or the calls."""

    def __init__(self, tools: Tools) -> None:
        self.start = None if tools.forced else _start_tag(tools.parser)
        self.live = tools.choice == "none" or (tools.choice == "auto" and self.start is not None)
        self.text: dict[int, str] = {}
        self.sent: dict[int, int] = {}

    def feed(self, index: int, delta: str) -> str:
        text = self.text[index] = self.text.get(index, "") + delta
        if not self.live:
            return ""
        sent = self.sent.get(index, 0)
        end = len(text)
        if self.start is not None:
            from vllm.tool_parsers.utils import partial_tag_overlap

            found = text.find(self.start)
            end = found if found >= 0 else len(text) - partial_tag_overlap(text, self.start)
        self.sent[index] = max(sent, end)
        return text[sent:end]

    def rest(self, index: int, called: bool) -> str:
        """The content not sent yet, once the reply is read: all the rest when it called no tool,
        else what came before the first call's tag."""
        whole, sent = self.text.get(index, ""), self.sent.get(index, 0)
        if not called:
            return whole[sent:]
        if self.start is not None and self.start in whole:
            return whole[sent:max(sent, whole.index(self.start))]
        return ""


def _start_tag(parser: str) -> str | None:
    from vllm.tool_parsers import ToolParserManager

    return getattr(ToolParserManager.get_tool_parser(parser), "tool_call_start_token", None)
