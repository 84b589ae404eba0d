"""The LLM that infer asks: the served model through kvmem's own engine, or an OpenAI-compatible API.

Both take chat messages and a JSON schema and return the reply's text, decoded under the schema.
The own engine is asked in text mode with no memory (chat mode "off"): extraction must read
what was said, not what is already stored. A failure to reach either is ExtractorUnavailable
(an EngineError: HTTP 503), raised before anything is stored.
"""

from __future__ import annotations

import logging
from typing import Protocol

from kvmem.chat import ChatArgs, Chats
from kvmem.config import ExtractConfig
from kvmem.engine.sampling import Sampling
from kvmem.errors import EngineError

log = logging.getLogger("kvmem.extract")
TIMEOUT_S = 120.0  # a small model on CPU takes tens of seconds for a long extraction


class ExtractorUnavailable(EngineError):
    """The extraction LLM could not be reached or failed; nothing of the add was stored.
    `param` and `code` as InvalidInputError's, for the HTTP error body."""

    code = "extractor_unavailable"

    def __init__(self, message: str, *, param: str | None = "infer") -> None:
        super().__init__(message)
        self.param = param


class LLM(Protocol):
    def complete(self, messages: list[dict], schema: dict, *, name: str, max_tokens: int, user_id: str) -> str:
        """The reply's text to `messages`, decoded under `schema` (`name`: the schema's name)."""


class EngineLLM:
    """The served model, through kvmem's own engine: greedy, text mode, no facts."""

    def __init__(self, chats: Chats) -> None:
        self.chats = chats

    def complete(self, messages: list[dict], schema: dict, *, name: str, max_tokens: int, user_id: str) -> str:
        max_tokens = min(max_tokens, self.chats.config.engine.max_model_len // 2)
        args = ChatArgs(user_id, mode="off", max_tokens=max_tokens, sampling=Sampling(json_schema=schema))
        try:
            return self.chats.chat(folded(messages), args).answer
        except EngineError as e:
            raise ExtractorUnavailable(f"the engine could not extract facts: {e}") from e


class OpenAILLM:
    """Any OpenAI-compatible /chat/completions with `response_format` json_schema (vLLM's,
    OpenAI's, kvmem serve's own)."""

    def __init__(self, url: str, model: str | None = None, api_key: str | None = None,
                 timeout_s: float = TIMEOUT_S) -> None:
        self.base = url.rstrip("/")
        self.url = self.base + "/chat/completions"
        self.model = model  # None: the API's first model, asked for once (GET /models)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s

    def complete(self, messages: list[dict], schema: dict, *, name: str, max_tokens: int, user_id: str) -> str:
        import httpx  # only when an endpoint is configured

        schema_format = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
        body = {"model": self.model or self._first_model(), "messages": messages, "temperature": 0,
                "max_tokens": max_tokens, "response_format": schema_format}
        try:
            r = httpx.post(self.url, json=body, headers=self.headers, timeout=self.timeout_s)
        except httpx.HTTPError as e:
            log.warning("extraction endpoint %s unreachable: %s", self.url, e)
            raise ExtractorUnavailable("the extraction endpoint is unreachable") from e
        if r.status_code != 200:
            # Its body stays in the log: the error goes back to API callers, who are not its operator.
            log.warning("extraction endpoint %s answered %s: %.500s", self.url, r.status_code, r.text)
            raise ExtractorUnavailable(f"the extraction endpoint answered {r.status_code}")
        try:
            return r.json()["choices"][0]["message"]["content"] or ""
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise ExtractorUnavailable("the extraction endpoint sent no chat completion") from e

    def _first_model(self) -> str:
        import httpx

        try:
            r = httpx.get(self.base + "/models", headers=self.headers, timeout=self.timeout_s)
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
            log.warning("extraction endpoint %s: GET /models failed: %s", self.base, e)
            raise ExtractorUnavailable("no model named for the extraction endpoint ([extract] model) and its "
                                       "GET /models did not name one") from e
        return self.model


def folded(messages: list[dict]) -> list[dict]:
    """System messages put in front of the first user turn: kvmem's own engine keeps the system
    message for itself (its head, which facts' KV is encoded after), as its HTTP server does."""
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    turns = [dict(m) for m in messages if m["role"] != "system"]
    if system and turns:
        turns[0]["content"] = f"{system}\n\n{turns[0]['content']}"
    return turns


def open_llm(config: ExtractConfig, chats: Chats) -> LLM:
    """The configured extraction LLM: [extract] url, else the served model."""
    if config.url:
        return OpenAILLM(config.url, config.model, config.api_key)
    return EngineLLM(chats)
