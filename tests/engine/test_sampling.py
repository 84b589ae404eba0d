"""Sampling: checked where it is made, and the same fields for vLLM in process and for a replica."""

from __future__ import annotations

import pytest

from kvmem.engine.sampling import MAX_N, Sampling
from kvmem.errors import InvalidInputError


def test_the_default_is_greedy():
    s = Sampling()
    assert s.temperature == 0.0 and s.n == 1 and not s.structured
    assert s.completions_fields()["temperature"] == 0.0 and "seed" not in s.completions_fields()


@pytest.mark.parametrize("fields, param", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p"),
    ({"seed": 1.5}, "seed"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"n": 0}, "n"), ({"n": MAX_N + 1}, "n"),
    ({"n": True}, "n"), ({"logit_bias": {5: 101.0}}, "logit_bias"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"stop": ("",)}, "stop"), ({"stop": ("a", "b", "c", "d", "e")}, "stop"),
    ({"stop_token_ids": (-3,)}, "stop_token_ids"), ({"json_schema": "not a dict"}, "response_format"),
    # Past what vLLM takes (issue 53): a seed beyond int64 failed its serialiser with OverflowError,
    # and an int past float's range made math.isfinite raise instead of the field's error.
    ({"seed": 2**63}, "seed"), ({"seed": -(2**63) - 1}, "seed"), ({"stop_token_ids": (2**31,)}, "stop_token_ids"),
    ({"logit_bias": {2**31: 1.0}}, "logit_bias"), ({"logit_bias": {5: 10**400}}, "logit_bias"),
    ({"temperature": 10**400}, "temperature"),
])
def test_bad_values_name_their_field(fields, param):
    with pytest.raises(InvalidInputError) as e:
        Sampling(**fields)
    assert e.value.param == param and e.value.code == InvalidInputError.INVALID_VALUE


def test_the_int64_ends_are_seeds():
    assert Sampling(seed=2**63 - 1).seed == 2**63 - 1 and Sampling(seed=-(2**63)).seed == -(2**63)


def test_a_replica_gets_the_fields_vllm_gets_in_process():
    schema = {"type": "object"}
    s = Sampling(temperature=0.7, top_k=5, seed=3, n=2, logit_bias={17: -5.0}, stop=("\n",), stop_token_ids=(2,),
                 json_schema=schema)
    body = s.completions_fields()
    assert body["logit_bias"] == {"17": -5.0} and body["structured_outputs"] == {"json": schema}
    assert (body["n"], body["seed"], body["stop"], body["stop_token_ids"]) == (2, 3, ["\n"], [2])
    kwargs = s.vllm_kwargs()
    assert kwargs["structured_outputs"].json == schema and kwargs["logit_bias"] == {17: -5.0}
    assert all(kwargs[k] == body[k] for k in ("n", "temperature", "top_k", "seed", "stop", "stop_token_ids"))
    assert Sampling(json_object=True).completions_fields()["structured_outputs"] == {"json_object": True}
