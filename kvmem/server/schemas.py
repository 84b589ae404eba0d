"""Request bodies, validated at the HTTP edge (pydantic lives here only).

Chat requests follow OpenAI's schema and ignore fields they do not use (clients send many);
memory requests forbid unknown fields, so a typo is a 400 that names it.

Types are strict, as OpenAI's and Mem0's APIs are: a string is not a boolean or an integer, and an
integer field takes no 1.5 or 2.0. A float field takes an integer (OpenAI's does: temperature 1).
Every integer is bounded here, so none reaches the engine wider than it can take (a seed beyond
64 bits was a 500 while vLLM serialised the request).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from kvmem.engine.sampling import INT64_MAX, INT64_MIN, MAX_N, MAX_TOKEN_ID, MAX_TOP_LOGPROBS

Mode = Literal["kv", "text", "off", "auto"]  # auto: kv where `kvmem verify` passed, else text
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]  # the widest integer vLLM takes (torch.long)
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
MAX_K = 100  # facts one chat or search retrieves
MAX_WINDOW = 64  # turns an add may fold into each fact


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# -- chat -----------------------------------------------------------------------------------------


class ContentPart(_Open):
    type: str
    text: str | None = None


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls (engine/tools.py checks them)
    tool_call_id: str | None = None  # a tool message: the call it answers


class MemoryOptions(_Strict):
    """The extra `memory` object of a chat request: whose facts, how many, how they reach the model."""

    user_id: str | None = None
    agent_id: str | None = None
    run_id: str | None = None
    k: int = Field(5, ge=1, le=MAX_K)
    mode: Mode = "kv"
    filters: dict[str, Any] | None = None
    text_facts: int | None = Field(None, ge=0, le=MAX_K)  # None: the server's kv.text_facts
    fidelity: Literal["fast", "balanced", "exact"] | None = None  # None: the server's kv.fidelity (kv/fidelity.py)
    # Write-back after the reply: the last user turn ("user"), and the reply ("both"), stored as
    # facts of the scope and encoded in the background; the response's memory.stored lists them.
    store: Literal["none", "user", "both"] = "none"


class StreamOptions(_Open):
    include_usage: bool = False


class ChatRequest(_Open):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # No bound of their own but the model's context (a 422 past it); int64 keeps the sum exact.
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    n: int = Field(1, ge=1, le=MAX_N)  # the server's max_n may cap it lower
    user: str | None = None
    memory: MemoryOptions | None = None
    # Sampling, as vLLM reads it (engine/sampling.py checks ranges and names the field); absent: greedy.
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)  # vLLM clamps it to the vocabulary
    min_p: float | None = Field(None, ge=0, le=1)
    seed: Int64 | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    logit_bias: dict[str, Any] | None = None  # checked in chat_format: the error names logit_bias
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: dict[str, Any] | None = None  # text, json_object or json_schema (chat_format)
    tools: list[Any] | None = None  # checked against vLLM's tool class in engine/tools.py (errors name tools)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


# -- memories -------------------------------------------------------------------------------------


class _Scope(_Strict):
    user_id: str
    agent_id: str | None = None
    run_id: str | None = None


class MemoryMessage(_Strict):
    role: Literal["user", "assistant", "system"]
    content: str
    name: str | None = None
    timestamp: str | None = None


class AddMemories(_Scope):
    """A conversation (`messages`: one fact per turn, or one string) or a list of `facts`."""

    messages: str | list[MemoryMessage] | None = None
    facts: list[str] | None = Field(None, min_length=1)
    metadata: dict[str, Any] | None = None
    window: int | None = Field(None, ge=0, le=MAX_WINDOW)
    timestamp: str | None = None  # facts only: when they held ("2023-05-09" or free text)
    origin: str = ""  # facts only: the message they were drawn from (searched with them, not encoded)
    encode: Literal["background", "sync"] = "background"
    expiration_date: str | None = None  # Mem0's: "2025-12-31" (through that day, UTC) or an ISO datetime


class SearchMemories(_Scope):
    query: str
    limit: int = Field(10, ge=1, le=MAX_K, validation_alias=AliasChoices("limit", "k"))
    filters: dict[str, Any] | None = None


class UpdateMemory(_Strict):
    text: str = Field(validation_alias=AliasChoices("text", "memory"))
    metadata: dict[str, Any] | None = None
    expiration_date: str | None = None  # left out: unchanged; null: never expires
