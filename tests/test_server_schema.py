"""The request bodies as pydantic models (issue 84, item 5): what each refuses and how its
400 reads, the one handler that names the field (``validated``, ``api_error``), and the
library's ``FieldError`` that carries its field instead of the server taking messages
apart. No server here: the server's own tests send these bodies over HTTP."""

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import paged_jax as pj
from paged_jax.errors import FieldError, with_context
from paged_jax.server.fields import ApiError
from paged_jax.server.jobs import _SAMPLING
from paged_jax.server.schema import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoraRequest,
    TokenizeRequest,
    api_error,
    validated,
)

CHAT = [{"role": "user", "content": "hi"}]


def _refused(model, body) -> ApiError:
    with pytest.raises(ApiError) as e:
        validated(model, body)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize(
    "model,body,param,message",
    [
        (CompletionRequest, {"prompt": "a"}, "model", "model: required"),
        (CompletionRequest, {"model": 7}, "model", "model: expected a string, got 7"),
        # strict: no text for numbers, no bools for ints
        (CompletionRequest, {"model": "m", "n": "2"}, "n", "n: expected an int, got '2'"),
        (CompletionRequest, {"model": "m", "n": True}, "n", "n: expected an int, got True"),
        (CompletionRequest, {"model": "m", "seed": 1.0}, "seed", "seed: expected an int, got 1.0"),
        (
            CompletionRequest,
            {"model": "m", "top_p": float("nan")},
            "top_p",
            "top_p: expected a finite number, got nan",
        ),
        (
            CompletionRequest,
            {"model": "m", "stream": "yes"},
            "stream",
            "stream: expected a bool, got 'yes'",
        ),
        (
            CompletionRequest,
            {"model": "m", "stream_options": {"include_usage": 1}},
            "stream_options",
            "stream_options.include_usage: expected a bool, got 1",
        ),
        # a union's failure reads as one expectation, not one per member
        (
            CompletionRequest,
            {"model": "m", "stop": ["x", 1]},
            "stop",
            "stop: expected a string or a list of strings, got ['x', 1]",
        ),
        (
            CompletionRequest,
            {"model": "m", "logprobs": 21},
            "logprobs",
            "logprobs: expected an int in [0, 20], got 21",
        ),
        (
            CompletionRequest,
            {"model": "m", "allowed_token_ids": [3, -1]},
            "allowed_token_ids",
            "allowed_token_ids[1]: expected >= 0, got -1",
        ),
        (
            CompletionRequest,
            {"model": "m", "logit_bias": {"5": "up"}},
            "logit_bias",
            "logit_bias.5: expected a number, got 'up'",
        ),
        (
            CompletionRequest,
            {"model": "m", "suffix": "x"},
            "suffix",
            "suffix: expected null (suffixes are not supported), got 'x'",
        ),
        (
            ChatRequest,
            {"model": "m", "messages": CHAT + [{"role": "robot", "content": "x"}]},
            "messages",
            "messages[1].role: expected one of 'system', 'developer', 'user', 'assistant' or "
            "'tool', got 'robot'",
        ),
        (
            ChatRequest,
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "messages",
            "messages[0].content: expected a string, a list of text parts, or null, got "
            "[{'type': 'image'}]",
        ),
        (ChatRequest, {"model": "m"}, "messages", "messages: required"),
        (
            ChatRequest,
            {"model": "m", "messages": CHAT, "top_logprobs": -1},
            "top_logprobs",
            "top_logprobs: expected an int in [0, 20], got -1",
        ),
        (
            ChatRequest,
            {"model": "m", "messages": CHAT, "response_format": {"type": "xml"}},
            "response_format",
            "response_format.type: expected one of 'text', 'json_object' or 'json_schema', "
            "got 'xml'",
        ),
        (
            ChatRequest,
            {
                "model": "m",
                "messages": CHAT,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x"}},
            },
            "response_format",
            "response_format.json_schema.schema: required",
        ),
        (
            EmbeddingRequest,
            {"model": "m", "input": "x", "encoding_format": "hex"},
            "encoding_format",
            "encoding_format: expected one of 'float' or 'base64', got 'hex'",
        ),
        (TokenizeRequest, {"prompt": 5}, "prompt", "prompt: expected a string, got 5"),
        (DetokenizeRequest, {"tokens": [1, "2"]}, "tokens", "tokens[1]: expected an int, got '2'"),
        (LoraRequest, {"lora_name": ""}, "lora_name", "lora_name: expected a non-empty string"),
    ],
)
def test_a_wrong_field_is_a_400_naming_it(model, body, param, message):
    e = _refused(model, body)
    assert e.param == param and e.message.startswith(message), e.message


def test_a_body_that_is_not_an_object_is_named_as_the_body():
    for body in ([], "x", 3, None):
        e = _refused(CompletionRequest, body)
        assert e.message == "body: expected a JSON object" and e.param is None


def test_valid_bodies_keep_their_values_and_unknown_fields():
    req = validated(
        CompletionRequest,
        {"model": "m", "prompt": [1, 2], "temperature": 1, "stop": "x", "user": "u"},
    )
    assert req.temperature == 1.0 and isinstance(req.temperature, float)  # ints are numbers
    assert req.prompt == [1, 2] and req.stop == "x" and req.model_extra == {"user": "u"}
    chat = validated(
        ChatRequest,
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]},
                {"role": "assistant", "tool_calls": [{"id": "c"}]},
            ],
        },
    )
    # what the chat template reads: text parts joined, keys it was not given left out
    assert [m.for_template() for m in chat.messages] == [
        {"role": "user", "content": "a"},
        {"role": "assistant", "tool_calls": [{"id": "c"}]},
    ]


def test_every_field_the_server_reads_is_declared():
    """A field read from the body but missing from a model would pass unchecked."""
    for name in _SAMPLING:
        model = ChatRequest if name == "max_completion_tokens" else CompletionRequest
        assert name in model.model_fields, name
    assert {"logprobs", "top_logprobs", "tools", "chat_template_kwargs"} <= set(
        ChatRequest.model_fields
    )


# any JSON value
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([CompletionRequest, ChatRequest, EmbeddingRequest, TokenizeRequest]),
    st.sampled_from(
        [
            "model",
            "n",
            "stop",
            "messages",
            "logit_bias",
            "response_format",
            "structured_outputs",
            "stream_options",
            "logprobs",
            "input",
            "dimensions",
            "guided_json",
        ]
    ),  # fmt: skip
    _JSON,
)
def test_any_value_of_any_field_is_accepted_or_a_400_naming_that_field(model, field, value):
    body = {"model": "m", "messages": CHAT, "prompt": "a", "input": "a", field: value}
    try:
        validated(model, body)
    except ApiError as e:
        assert e.status == 400 and e.param == field and e.message.startswith(field), e.message


def test_the_library_s_errors_carry_their_field():
    with pytest.raises(FieldError) as e:
        pj.SamplingParams(top_p=2.0)
    assert e.value.field == "top_p" and str(e.value) == "top_p: expected a float in (0, 1], got 2.0"
    with pytest.raises(FieldError) as e:
        pj.SamplingParams(logit_bias={"7": 500})
    assert e.value.field == "logit_bias['7']"
    # the server's param: the body's field; "params." and positions dropped, renamed where
    # the body spelled it otherwise
    assert api_error(e.value).param == "logit_bias"
    e = api_error(
        FieldError("params.max_tokens", "too many"), {"max_tokens": "max_completion_tokens"}
    )
    assert (e.param, e.message) == ("max_completion_tokens", "max_completion_tokens: too many")
    e = api_error(FieldError("params.structured.regex", "bad"), {"structured": "guided_regex"})
    assert (e.param, e.message) == ("guided_regex", "guided_regex: bad")
    assert api_error(FieldError("params.stop", "needs a tokenizer")).message == (
        "stop: needs a tokenizer"
    )
    e = api_error(ValueError("something: else"))  # no field: none is guessed from the text
    assert (e.param, e.message) == (None, "something: else")


def test_a_field_error_keeps_its_field_in_context_and_across_processes():
    e = with_context(FieldError("top_k", "expected an int"), "prompts[3]")
    assert isinstance(e, FieldError) and e.field == "top_k"
    assert str(e) == "prompts[3]: top_k: expected an int"
    again = pickle.loads(pickle.dumps(e))
    assert (type(again), again.field, str(again)) == (FieldError, "top_k", str(e))
    plain = with_context(TypeError("x: bad"), "prompts[0]")
    assert type(plain) is TypeError and str(plain) == "prompts[0]: x: bad"


def test_a_request_s_position_stays_in_the_message_and_renames_name_the_body_s_field():
    e = api_error(with_context(FieldError("params.stop", "needs a tokenizer"), "prompts[2]"))
    assert (e.param, e.message) == ("stop", "prompts[2]: stop: needs a tokenizer")
    e = api_error(with_context(FieldError("prompt", "too long"), "prompts[1]"), {"prompt": "input"})
    assert (e.param, e.message) == ("input", "input: too long")
