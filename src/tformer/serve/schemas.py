"""The OpenAI wire format: request bodies (validated), response objects, stream chunks, error bodies.

Requests are pydantic models that accept the fields OpenAI documents and ignore unknown ones (clients
send extras); a field tformer cannot honour (``suffix``, ...) is refused
with a 400 naming it rather than silently ignored.
``response_format`` (structured output) is validated here and applied by :mod:`tformer.serve.grammar`. Responses are plain dicts built by the helpers
below, shaped exactly like OpenAI's (``id``, ``object``, ``created``, ``model``, ``choices``,
``usage``), so the official client parses them into its own types.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator

from tformer.generation.penalties import Penalties

INT64 = 2**63           # OpenAI's seed is a signed 64-bit integer


class APIError(Exception):
    """An error to send as OpenAI's ``{"error": {...}}`` body with HTTP ``status`` (and ``headers``,
    e.g. ``Retry-After`` on a 429)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr
    max_tokens: StrictInt | None = Field(default=None, ge=0)
    temperature: StrictFloat = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)   # not true, not "0.5"
    top_p: StrictFloat = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: StrictInt | None = Field(default=None, ge=1)            # not OpenAI's; vLLM and others accept it
    n: StrictInt = Field(default=1, ge=1, le=16)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = Field(default=None, ge=-INT64, lt=INT64)
    min_p: StrictFloat | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)     # vLLM's, llama.cpp's
    repetition_penalty: StrictFloat = Field(default=1.0, gt=0.0, le=10.0, allow_inf_nan=False)  # vLLM's, llama.cpp's
    presence_penalty: StrictFloat = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: StrictFloat = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, StrictFloat] | None = None        # {"token id": bias in [-100, 100]}
    user: StrictStr | None = None

    @model_validator(mode="after")
    def _supported(self):
        for key in self.logit_bias or {}:
            if not key.isdigit():
                raise ValueError(f'logit_bias keys are token ids as strings ("50256"), not {key!r}')
        self.penalties().check()              # generation's own ranges (an InputError is a ValueError)
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ValueError("stop takes at most 4 strings")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def penalties(self) -> Penalties:
        bias = tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))
        return Penalties(self.repetition_penalty, self.presence_penalty, self.frequency_penalty, bias)

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=5)
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None
    return_tokens_as_token_ids: StrictBool = False     # vLLM's extension: logprobs tokens as "token_id:<id>"

    @model_validator(mode="after")
    def _completion_only(self):
        if self.suffix:
            raise ValueError("suffix (insertion) is not supported; leave it out")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported; leave it out or set it equal to n")
        return self


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr
    arguments: StrictStr                 # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None      # an assistant's earlier calls
    tool_call_id: StrictStr | None = None         # a tool message: the call it answers

    @model_validator(mode="after")
    def _has_content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant message with tool_calls may "
                             f"leave it out)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class JSONSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's ``name`` (required), ``schema``, ``strict``, ``description``."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: StrictStr = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None
    description: StrictStr | None = None


class ResponseFormat(BaseModel):
    """``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {...}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs json_schema: {"name": ..., "schema": {...}}')
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f'json_schema is only allowed with type "json_schema", not "{self.type}"')
        return self


class Function(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: Function


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=0)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = Field(default=None, max_length=64)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _chat_only(self):
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice other than none / auto needs tools")
        if isinstance(self.tool_choice, dict):
            name = (self.tool_choice.get("function") or {}).get("name")
            if self.tool_choice.get("type") != "function" or name not in {t.function.name for t in self.tools}:
                raise ValueError('tool_choice names a function: {"type": "function", "function": {"name": ...}} '
                                 'with the name of one of tools')
        if self.tools and self.tool_choice not in (None, "none") and self.response_format is not None \
                and self.response_format.type != "text":
            raise ValueError("response_format and tools cannot be combined; send one of them")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


class InputPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["input_text", "output_text", "text"]
    text: StrictStr


class InputMessage(BaseModel):
    """A Responses ``input`` message: a role and a string or text parts."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[InputPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponsesRequest(_Sampling):
    """``POST /v1/responses``: ``input`` and ``instructions`` instead of ``messages``, ``max_output_tokens``."""

    input: StrictStr | list[InputMessage] = Field(min_length=1)
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    tools: list[Any] | None = None

    @model_validator(mode="after")
    def _responses_only(self):
        if self.tools:
            raise ValueError("tools are not supported on /v1/responses; use /v1/chat/completions for tool calls")
        if self.n != 1:
            raise ValueError("n is not a Responses option; leave it out")
        return self


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: StrictStr
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]] = Field(min_length=1)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: StrictStr | None = None


# ------------------------------------------------------------------------------ response shapes
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_object(id_: str, model: str, choices: list[dict], use: dict | None, chunk: bool = False) -> dict:
    """``text_completion`` (a full response, or one stream chunk: same object name in OpenAI's API)."""
    out = {"id": id_, "object": "text_completion", "created": now(), "model": model, "choices": choices}
    if use is not None or not chunk:
        out["usage"] = use
    return out


def chat_object(id_: str, model: str, choices: list[dict], use: dict | None, chunk: bool = False) -> dict:
    """``chat.completion``, or a ``chat.completion.chunk`` when ``chunk``."""
    out = {"id": id_, "object": "chat.completion.chunk" if chunk else "chat.completion", "created": now(),
           "model": model, "system_fingerprint": None, "choices": choices}
    if use is not None or not chunk:
        out["usage"] = use
    return out
