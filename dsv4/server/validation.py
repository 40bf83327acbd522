"""Typed request bodies (msgspec) and the checks that turn bad input into a 4xx naming the field."""

from __future__ import annotations

import asyncio
import re
from typing import Annotated

import msgspec
from aiohttp import ClientPayloadError, web

from dsv4.config import ServerArgs
from dsv4.engine.logprobs import MAX_TOP_LOGPROBS
from dsv4.protocol import SamplingParams
from dsv4.server.errors import ApiError, ClientGone, bad_request

MAX_STOP_SEQUENCES = 16
MAX_CHOICES = 64  # each choice is a running request
# Bodies nested deeper are refused before they are decoded. The decoder recurses once per level, so
# the interpreter's recursion limit bounds it too, but that limit is not ours to rely on: libraries
# raise it (torch's inductor sets at least 2000 when it compiles, as the startup compile does).
MAX_JSON_NESTING = 128

# Ranges of every numeric field, enforced where the body is decoded so that nothing out of range
# reaches the engine, a frame encoder or a kernel. Seeds take torch's int64 range, as vLLM does;
# counts fit 32 bits.
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
Count = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]  # signed: a negative count gets its own message
TopK = Annotated[int, msgspec.Meta(ge=-1, le=2**31 - 1)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
Probability = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]  # OpenAI's presence and frequency penalties
RepetitionPenalty = Annotated[float, msgspec.Meta(gt=0.0, le=2.0)]
LogitBias = Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]
StopList = Annotated[list[str], msgspec.Meta(max_length=MAX_STOP_SEQUENCES)]
TopLogprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)]  # alternatives per token: vLLM's limit

# msgspec reports where a value failed as "... - at `$.messages[0].role`", or names a missing
# field as "missing required field `model`"; both become the OpenAI `param`.
_AT_PATH = re.compile(r"- at `\$\.?(?P<path>[^`]*)`")
_MISSING_FIELD = re.compile(r"missing required field `(?P<name>[^`]+)`")
_UNKNOWN_FIELD = re.compile(r"unknown field `(?P<name>[^`]+)`")
_OUT_OF_RANGE = re.compile(r"^(Expected `\w+` [<>]=? |Expected `\w+` of length|Number out of range)")


# -- bodies ----------------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # a JSON object serialised as a string, as OpenAI sends it


class ToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    function: FunctionCall
    id: str | None = None
    type: str = "function"


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str
    # A list holds content parts ({"type": "text", "text": ...}); the encoder renders them.
    content: str | list[dict] | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class FunctionDef(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDef(msgspec.Struct, kw_only=True):
    function: FunctionDef
    type: str = "function"


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    function: NamedFunction
    type: str = "function"


class JsonSchemaSpec(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    description: str | None = None
    schema: dict | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: str
    json_schema: JsonSchemaSpec | None = None


class OpenAISampling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Sampling fields shared by /v1/chat/completions and /v1/completions. A field dsv4 does not
    implement is refused (400 naming it), never silently ignored; the subclasses inherit that."""

    model: str | None = None
    max_tokens: Count | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    top_k: TopK | None = None  # extension, as in vLLM and SGLang
    seed: Seed | None = None
    stop: str | StopList | None = None
    stop_token_ids: list[Count] | None = None  # extension
    ignore_eos: bool = False  # extension
    n: Count = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Accepted and ignored: they carry no behaviour.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Logits processors, with their documented ranges.
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None  # extension
    min_p: Probability | None = None  # extension
    logit_bias: dict[str, LogitBias] | None = None


class ChatCompletionBody(OpenAISampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: Count | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    # Tools and response_format are kept raw so that they reach the prompt in the client's key
    # order (the encoder re-serialises them verbatim); each is still validated against its Struct.
    response_format: msgspec.Raw = msgspec.Raw()  # empty when absent (msgspec has no Raw | None)
    tools: list[msgspec.Raw] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # the DSML format always allows several calls
    reasoning_effort: str | None = None
    chat_template_kwargs: dict | None = None


class CompletionBody(OpenAISampling, kw_only=True):
    # str, token ids, or a batch of one of either (msgspec allows one array type per union)
    prompt: str | list[str | int | list[int]]
    logprobs: TopLogprobs | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Count | None = None
    response_format: ResponseFormat | None = None


class NativeSampling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's `sampling_params`."""

    max_new_tokens: Count = 128
    temperature: Temperature = 1.0
    top_p: Probability = 1.0
    top_k: TopK = -1
    stop: str | StopList | None = None
    stop_token_ids: list[Count] | None = None
    seed: Seed | None = None
    ignore_eos: bool = False
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    min_p: Probability = 0.0
    logit_bias: dict[str, LogitBias] | None = None
    json_schema: str | None = None  # constrained decoding, as SGLang: a JSON schema serialised as a string
    regex: str | None = None


class GenerateBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    input_ids: list[Count] | None = None
    text: str | None = None
    sampling_params: NativeSampling = msgspec.field(default_factory=NativeSampling)
    stream: bool = False
    # SGLang's logprob fields: output-token logprobs, and prompt logprobs from logprob_start_len on
    # (-1: none), each with top_logprobs_num alternatives; texts only with return_text_in_logprobs.
    return_logprob: bool = False
    top_logprobs_num: TopLogprobs = 0
    logprob_start_len: Count = -1
    return_text_in_logprobs: bool = False


# -- decoding --------------------------------------------------------------------------------------


async def decode_body(request: web.Request, body_type: type, args: ServerArgs):
    """The body, read within --body-read-timeout and --max-request-bytes, decoded as `body_type`."""
    max_bytes = args.max_request_bytes
    declared = request.content_length
    if declared is not None and declared > max_bytes:
        raise _too_large(max_bytes)
    try:
        async with asyncio.timeout(args.body_read_timeout):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(max_bytes) from None
    except TimeoutError:
        raise ApiError(408, f"the request body was not received within {args.body_read_timeout:g} s",
                       code="request_timeout", close_connection=True) from None
    except (ConnectionError, ClientPayloadError) as e:  # the client left while sending
        raise ClientGone(f"while sending its body: {e}") from None
    return decode_json(raw, body_type)


def decode_json(raw: bytes, body_type: type):
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"request body is not valid UTF-8 (byte {e.start})", code="invalid_utf8") from None
    if _nesting_exceeds(raw, MAX_JSON_NESTING):
        raise too_deep()
    return _decode(raw, body_type, "")


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _nesting_exceeds(raw: bytes, limit: int) -> bool:
    """Whether the JSON text's arrays and objects nest deeper than `limit` (brackets inside strings
    do not count)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:  # (almost every body: too few to nest that deep)
        return False
    depth = 0
    for bracket in _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS):
        depth += 1 if bracket in b"[{" else -1
        if depth > limit:
            return True
    return False


def decode_part(raw: msgspec.Raw, part_type: type, path: str):
    """Validates one raw part of an already decoded body; errors name `path` and below."""
    return _decode(raw, part_type, path)


def _decode(raw, body_type: type, path_prefix: str):
    try:
        return msgspec.json.decode(raw, type=body_type)
    except msgspec.ValidationError as e:
        message = str(e)
        if _UNKNOWN_FIELD.search(message):
            code, message = "unknown_parameter", f"{message}: dsv4 does not implement it"
        elif _OUT_OF_RANGE.search(message):
            code = "invalid_value"
        else:
            code = "invalid_type"
        raise bad_request(message, param=_join(path_prefix, _field_of(str(e))), code=code) from None
    except msgspec.DecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise too_deep() from None


def too_deep():
    return bad_request(f"request body is nested too deeply (at most {MAX_JSON_NESTING} levels)", code="invalid_json")


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"request body exceeds {max_bytes} bytes", code="request_too_large")


def _field_of(message: str) -> str | None:
    at = _AT_PATH.search(message)
    path = at.group("path") if at else ""
    named = _MISSING_FIELD.search(message) or _UNKNOWN_FIELD.search(message)
    if named:
        path = _join(path, named.group("name"))
    return path or None


def _join(prefix: str, path: str | None) -> str | None:
    if not prefix:
        return path
    if not path:
        return prefix
    return prefix + path if path.startswith("[") else f"{prefix}.{path}"


# -- checks shared by every generation route -------------------------------------------------------


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise ApiError(404, f"model {requested!r} does not exist; this server serves {served!r}",
                       param="model", code="model_not_found")


def check_prompt_ids(ids: list[int], vocab_size: int, param: str) -> None:
    if not ids:
        raise bad_request("the prompt is empty", param=param)
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise bad_request(f"token id {token} at index {i} is outside the vocabulary [0, {vocab_size})",
                              param=param, code="invalid_token_id")


# Texts longer than this are tokenised on a worker thread, so that the event loop keeps answering.
INLINE_TOKENIZE_CHARS = 16 * 1024


async def tokenize(tokenizer, text: str, max_context: int, param: str) -> list[int]:
    """Token ids of a prompt text. A text that cannot fit the context is refused from its length
    alone, before tokenising (a multi-megabyte prompt would take seconds to tokenise)."""
    at_least = -(-len(text) // tokenizer.max_token_bytes)
    if at_least >= max_context:
        raise bad_request(f"the prompt has at least {at_least} tokens ({len(text)} characters); this model's "
                          f"context is {max_context} tokens", param=param, code="context_length_exceeded")
    if len(text) <= INLINE_TOKENIZE_CHARS:
        return list(tokenizer.encode(text))
    return list(await asyncio.to_thread(tokenizer.encode_without_gil, text))


def check_fits(prompt_len: int, max_new_tokens: int, max_context: int, prompt_param: str, tokens_param: str) -> None:
    if prompt_len >= max_context:
        raise bad_request(
            f"the prompt has {prompt_len} tokens; this model's context is {max_context} tokens",
            param=prompt_param, code="context_length_exceeded",
        )
    if prompt_len + max_new_tokens > max_context:
        raise bad_request(
            f"{tokens_param}={max_new_tokens} with a {prompt_len}-token prompt exceeds the {max_context}-token"
            f" context; at most {max_context - prompt_len} new tokens fit",
            param=tokens_param, code="context_length_exceeded",
        )


def make_sampling(
    fields: OpenAISampling | NativeSampling,
    *,
    max_new_tokens: int,
    tokens_param: str,
    vocab_size: int,
    field_prefix: str = "",
    hidden_token_ids: tuple[int, ...] = (),
    grammar: str | None = None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    prompt_logprobs_start: int = 0,
) -> SamplingParams:
    """The engine's sampling parameters from a body's sampling fields (the OpenAI routes and the
    native `sampling_params` share their names); `field_prefix` names where those fields sit in the
    body ("sampling_params." natively)."""
    f = field_prefix
    if max_new_tokens < 1:
        raise bad_request(f"{tokens_param} must be at least 1, got {max_new_tokens}", param=tokens_param)
    # Every other range is enforced when the body is decoded.
    if fields.top_p == 0.0:
        raise bad_request("top_p must be within (0, 1], got 0", param=f + "top_p")
    stops = (fields.stop,) if isinstance(fields.stop, str) else tuple(fields.stop or ())
    if any(not s for s in stops):
        raise bad_request("stop sequences must not be empty", param=f + "stop")
    for token in fields.stop_token_ids or ():
        if not 0 <= token < vocab_size:
            raise bad_request(f"stop token id {token} is outside the vocabulary", param=f + "stop_token_ids")
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=1.0 if fields.temperature is None else fields.temperature,
        top_p=1.0 if fields.top_p is None else fields.top_p,
        top_k=-1 if not fields.top_k else fields.top_k,  # 0 means "no cut" too, as in vLLM
        seed=fields.seed,
        stop=stops,
        stop_token_ids=tuple(fields.stop_token_ids or ()),
        ignore_eos=fields.ignore_eos,
        hidden_token_ids=hidden_token_ids,
        presence_penalty=fields.presence_penalty or 0.0,
        frequency_penalty=fields.frequency_penalty or 0.0,
        repetition_penalty=1.0 if fields.repetition_penalty is None else fields.repetition_penalty,
        min_p=fields.min_p or 0.0,
        logit_bias=_logit_bias(fields.logit_bias, vocab_size, f + "logit_bias"),
        grammar=grammar,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        prompt_logprobs_start=prompt_logprobs_start,
    )


def _logit_bias(bias: dict[str, float] | None, vocab_size: int, param: str) -> tuple[tuple[int, float], ...]:
    """OpenAI sends token ids as the keys of a JSON object, hence strings."""
    pairs = []
    for key, value in (bias or {}).items():
        if not key.isascii() or not key.isdigit() or not int(key) < vocab_size:
            raise bad_request(f"logit_bias key {key!r} is not a token id in [0, {vocab_size})", param=param)
        pairs.append((int(key), value))
    return tuple(pairs)


def check_choices(n: int) -> None:
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"n must be within [1, {MAX_CHOICES}], got {n}", param="n")