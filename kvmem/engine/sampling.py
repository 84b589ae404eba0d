"""How a chat's tokens are chosen: vLLM's sampling parameters, one typed value for every engine.

`Sampling()` is greedy decoding (temperature 0), what kvmem did before it took sampling fields
and what a request that names none still gets. Checked where it is made (InvalidInputError naming
the field), so an engine never sees a value vLLM would refuse mid-batch. The in-process engine
turns it into vLLM's SamplingParams (`vllm_kwargs`), the remote one into the fields of vLLM's
OpenAI completions API (`completions_fields`): the same semantics either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvmem.errors import InvalidInputError

MAX_N = 8  # choices per request; a server may set a lower cap
MAX_TOP_LOGPROBS = 20  # OpenAI's bound
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # vLLM's seed is a torch.long; a wider int fails its serialiser
MAX_TOKEN_ID = 2**31 - 1  # vLLM holds token ids as int32
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound, either way


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # token id -> added to its logit
    stop: tuple[str, ...] = ()  # the text ends before the first of these (not included)
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1  # choices, each reading the same prompt (in KV mode, the same injected facts)
    json_schema: Mapping[str, Any] | None = None  # the reply is JSON valid against this schema
    json_object: bool = False  # the reply is a JSON object
    schema_from: str = "response_format"  # the request field a schema came from, blamed if it cannot be used

    def __post_init__(self) -> None:
        _check_number("temperature", self.temperature, 0.0, 2.0)
        _check_number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, -1)
        _check_number("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, INT64_MIN, INT64_MAX)
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_number("repetition_penalty", self.repetition_penalty, 0.0, 2.0, low_open=True)
        _check_int("n", self.n, 1, MAX_N)
        self._check_bias()
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidInputError("stop must be non-empty strings", param="stop")
        if len(self.stop) > 4:
            raise InvalidInputError(f"at most 4 stop sequences, got {len(self.stop)}", param="stop")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0, MAX_TOKEN_ID)
        if self.json_schema is not None and not isinstance(self.json_schema, Mapping):
            raise InvalidInputError("a JSON schema must be an object", param=self.schema_from)

    def _check_bias(self) -> None:
        if not isinstance(self.logit_bias, Mapping) or len(self.logit_bias) > 300:
            raise InvalidInputError("logit_bias must map at most 300 token ids to biases", param="logit_bias")
        for token, bias in self.logit_bias.items():
            _check_int("logit_bias", token, 0, MAX_TOKEN_ID)
            _check_number("logit_bias", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)

    @property
    def structured(self) -> bool:
        return self.json_schema is not None or self.json_object

    def vllm_kwargs(self) -> dict[str, Any]:
        """SamplingParams' keyword arguments (the caller adds max_tokens, logprobs, ...)."""
        kwargs: dict[str, Any] = {
            "n": self.n, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "seed": self.seed, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
            "stop": list(self.stop) or None, "stop_token_ids": list(self.stop_token_ids) or None,
            "logit_bias": dict(self.logit_bias) or None,
        }
        if self.structured:
            from vllm.sampling_params import StructuredOutputsParams

            kwargs["structured_outputs"] = StructuredOutputsParams(
                json=dict(self.json_schema) if self.json_schema is not None else None,
                json_object=True if self.json_schema is None else None)
        return kwargs

    def completions_fields(self) -> dict[str, Any]:
        """The same, as fields of vLLM's OpenAI completions request (a replica's API)."""
        body: dict[str, Any] = {
            "n": self.n, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
        }
        if self.seed is not None:
            body["seed"] = self.seed
        if self.stop:
            body["stop"] = list(self.stop)
        if self.stop_token_ids:
            body["stop_token_ids"] = list(self.stop_token_ids)
        if self.logit_bias:
            body["logit_bias"] = {str(t): b for t, b in self.logit_bias.items()}
        if self.structured:
            body["structured_outputs"] = {"json": dict(self.json_schema)} if self.json_schema is not None \
                else {"json_object": True}
        return body


def _check_number(name: str, value: object, low: float, high: float, *, low_open: bool = False) -> None:
    # An int is compared as it is: math.isfinite would raise OverflowError on one past float's range.
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (isinstance(value, int)
                                                                              or math.isfinite(value))
    if not ok or value > high or value < low or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise InvalidInputError(f"{name} must be a number in {bound}, got {value!r}", param=name)


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidInputError(f"{name} must be an int {bound}, got {value!r}", param=name)
