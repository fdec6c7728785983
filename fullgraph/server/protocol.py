"""Request bodies of the OpenAI API onto ``SamplingParams``; errors in OpenAI's shape.

Field policy (the README's "Serve it" says the same):
- **Unknown fields are ignored**, as OpenAI's own server and vLLM do, so clients that send newer
  or vendor fields (``user``, ``metadata``, ``store``, ``service_tier``, ...) keep working.
- **Known fields this server cannot honour are refused** with a 400 naming them when they are set
  to anything but their neutral value (``presence_penalty`` other than 0, ``logit_bias``, ``echo``,
  ``suffix``, ``best_of`` other than ``n``, ``tools``, ...): silently ignoring them would change
  the output without saying so.
- Values are checked by ``SamplingParams`` and the engine; their ``ValueError`` text, which names
  the field, becomes the message of the 400 (``param`` set to the field).
"""
from __future__ import annotations

import numbers
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..engine import SamplingParams, Structured

MAX_CHOICES = 256  # engine requests one HTTP request may start (prompts x n)


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
             405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


_ENGINE_FIELD = re.compile(r"^(?:request '[^']*': |SamplingParams\.)(\w+): ")
_PARAM_NAMES = {"structured": "response_format", "params": None, "request_id": None}


def from_value_error(err: ValueError) -> ApiError:
    """The engine's / SamplingParams' ``ValueError`` (it names the field) as a 400."""
    text = str(err)
    match = _ENGINE_FIELD.match(text)
    field = match.group(1) if match else None
    if match and text.startswith("request '"):
        text = text[text.index(": ") + 2:]  # the internal request id means nothing to the client
    return bad(text, _PARAM_NAMES.get(field, field))


@dataclass(frozen=True)
class Served:
    """What the loaded model offers, for checking bodies."""

    names: tuple[str, ...]
    max_logprobs: int
    has_tokenizer: bool
    structured: bool


@dataclass(frozen=True)
class Job:
    """One parsed HTTP request: ``prompts`` (completions: text or token ids; chat: one list of
    messages) times ``n`` choices; choice ``k`` is prompt ``k // n`` with ``params[k]``."""

    id: str
    kind: str                               # "completion" | "chat"
    model: str
    prompts: tuple
    n: int
    params: tuple[SamplingParams, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None                    # top logprobs per token; None: no logprobs
    return_token_ids: bool

    @property
    def num_choices(self) -> int:
        return len(self.params)


# field -> the values that mean "off"; anything else is refused (see the module docstring)
_NEUTRAL = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
            "logit_bias": ({},), "min_tokens": (0,), "prompt_logprobs": (0,), "suffix": ("",), "echo": (False,),
            "tools": ([],), "functions": ([],), "function_call": ("none",), "tool_choice": ("none", "auto"),
            "audio": (), "prediction": (), "modalities": (["text"],), "logits_processors": ([],)}


def _get(body: dict, name: str, kinds: tuple, what: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise bad(f"{name}: expected {what}, got {type(value).__name__} {_short(value)}", name)
    return value


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_INT, _NUM, _BOOL, _STR = (numbers.Integral,), (numbers.Real,), (bool,), (str,)


def _check_unsupported(body: dict, n: int) -> None:
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and value not in neutral:
            raise bad(f"{name}: not supported by this server (fullgraph); leave it out"
                      + (f" or set it to {neutral[0]!r}" if neutral else ""), name)
    best_of = _get(body, "best_of", _INT, "an int", n)
    if best_of != n:
        raise bad(f"best_of: only best_of == n is supported, got best_of={best_of}, n={n}", "best_of")


def _structured(body: dict, served: Served) -> Structured | None:
    """``response_format`` and vLLM's ``guided_*`` fields onto one ``Structured`` (at most one)."""
    given = {}
    fmt = _get(body, "response_format", (dict,), "an object")
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            given["response_format"] = {"json_schema": {"type": "object"}}
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, (dict, bool)):
                raise bad("response_format: type json_schema needs json_schema.schema (an object)", "response_format")
            given["response_format"] = {"json_schema": schema if isinstance(schema, dict) else {}}
        elif kind != "text":
            raise bad(f"response_format.type: expected 'text', 'json_object' or 'json_schema', got {_short(kind)}",
                      "response_format")
    for name, key, kinds, what in (("guided_json", "json_schema", (dict, str), "an object or its JSON text"),
                                   ("guided_regex", "regex", _STR, "a string"),
                                   ("guided_choice", "choice", (list,), "a list of strings"),
                                   ("guided_grammar", "grammar", _STR, "a string (Lark)")):
        value = _get(body, name, kinds, what)
        if value is not None:
            given[name] = {key: value}
    if not given:
        return None
    if len(given) > 1:
        raise bad(f"give at most one output constraint, got {sorted(given)}", sorted(given)[1])
    (name, kwargs), = given.items()
    if not served.structured:
        raise bad(f"{name}: structured output is off on this server (it needs llguidance: "
                  "pip install 'fullgraph[structured]')", name)
    try:
        return Structured(**kwargs)
    except ValueError as err:
        raise bad(f"{name}: {err}", name) from None


def _stop_ids(body: dict) -> list[int] | None:
    ids = _get(body, "stop_token_ids", (list,), "a list of token ids")
    if ids is not None and any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise bad("stop_token_ids: expected a list of ints", "stop_token_ids")
    return ids


def _sampling(body: dict, max_tokens: int | None, logprobs: int | None, served: Served, n: int) -> list[SamplingParams]:
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and (
            not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise bad(f"stop: expected a string or a list of strings, got {_short(stop)}", "stop")
    seed = _get(body, "seed", _INT, "an int")
    kw = dict(temperature=_get(body, "temperature", _NUM, "a number", 1.0),
              top_p=_get(body, "top_p", _NUM, "a number", 1.0),
              top_k=_get(body, "top_k", _INT, "an int", -1), min_p=_get(body, "min_p", _NUM, "a number", 0.0),
              max_tokens=max_tokens, stop=stop, stop_token_ids=_stop_ids(body),
              ignore_eos=_get(body, "ignore_eos", _BOOL, "true or false", False), logprobs=logprobs,
              skip_special_tokens=_get(body, "skip_special_tokens", _BOOL, "true or false", True),
              include_stop_str_in_output=_get(body, "include_stop_str_in_output", _BOOL, "true or false", False),
              structured=_structured(body, served))
    if kw["top_k"] == 0:
        kw["top_k"] = -1  # vLLM and OpenAI-style clients send 0 for "off"
    try:
        first = SamplingParams(seed=seed, **kw)
        # n choices are n engine requests; a seed gives each its own stream, derived deterministically
        return [first] + [replace(first, seed=None if seed is None else (seed + i) % 2**63) for i in range(1, n)]
    except ValueError as err:
        raise from_value_error(err) from None


def _common(body: dict, served: Served) -> tuple[str, int, bool, bool]:
    model = _get(body, "model", _STR, "a string", served.names[0])
    if model not in served.names:
        raise bad(f"model: {model!r} is not served here; this server serves {list(served.names)}", "model",
                  "model_not_found")
    n = _get(body, "n", _INT, "an int", 1)
    if not 1 <= n <= MAX_CHOICES:
        raise bad(f"n: must be in [1, {MAX_CHOICES}], got {n}", "n")
    _check_unsupported(body, n)
    stream = _get(body, "stream", _BOOL, "true or false", False)
    options = _get(body, "stream_options", (dict,), "an object", {})
    include_usage = bool(stream and options.get("include_usage"))
    return model, n, stream, include_usage


def _logprobs_limit(value: int | None, name: str, served: Served) -> int | None:
    if value is not None and not 0 <= value <= served.max_logprobs:
        limit = (f"at most {served.max_logprobs} (the server's --max-logprobs)" if served.max_logprobs
                 else "off on this server (started with --max-logprobs 0)")
        raise bad(f"{name}: {value} asked for; logprobs are {limit}", name)
    return value


def parse_completion(body: dict, served: Served) -> Job:
    """``POST /v1/completions``: ``prompt`` is a string, a list of token ids, or a list of either."""
    model, n, stream, include_usage = _common(body, served)
    prompts = _prompts(body.get("prompt"))
    if len(prompts) * n > MAX_CHOICES:
        raise bad(f"prompt: {len(prompts)} prompts x n={n} is more than {MAX_CHOICES} choices", "prompt")
    logprobs = _logprobs_limit(_get(body, "logprobs", _INT, "an int (how many top logprobs)"), "logprobs", served)
    params = _sampling(body, _get(body, "max_tokens", _INT, "an int", 16), logprobs, served, n)
    return Job("cmpl-" + uuid.uuid4().hex[:24], "completion", model, tuple(prompts), n,
               tuple(params) * len(prompts), stream, include_usage, logprobs,
               _get(body, "return_token_ids", _BOOL, "true or false", not served.has_tokenizer))


def _prompts(prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) and p and all(
                isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
            return list(prompt)
    if prompt is None:
        raise bad("prompt: required (a string, a list of token ids, or a list of either)", "prompt")
    raise bad(f"prompt: expected a string, a non-empty list of token ids, or a list of either, got {_short(prompt)}",
              "prompt")


def parse_chat(body: dict, served: Served) -> Job:
    """``POST /v1/chat/completions``: ``messages`` with text content (a string or text parts)."""
    model, n, stream, include_usage = _common(body, served)
    messages = _messages(body.get("messages"))
    want = _get(body, "logprobs", _BOOL, "true or false", False)
    top = _get(body, "top_logprobs", _INT, "an int")
    if top is not None and not want:
        raise bad("top_logprobs: needs logprobs=true", "top_logprobs")
    logprobs = _logprobs_limit(top or 0, "top_logprobs", served) if want else None
    max_tokens = _get(body, "max_completion_tokens", _INT, "an int")
    max_tokens = max_tokens if max_tokens is not None else _get(body, "max_tokens", _INT, "an int")
    params = _sampling(body, max_tokens, logprobs, served, n)
    return Job("chatcmpl-" + uuid.uuid4().hex[:24], "chat", model, (messages,), n, tuple(params), stream,
               include_usage, logprobs, _get(body, "return_token_ids", _BOOL, "true or false", False))


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad("messages: required, a non-empty list of {role, content}", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}]: expected an object with a string role, got {_short(m)}", "messages")
        out.append({"role": "system" if m["role"] == "developer" else m["role"],
                    "content": _content(m.get("content"), i)})
    return out


def _content(content, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, Sequence) and not isinstance(content, (str, bytes)):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) are "
                          f"supported, got {_short(part)}", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"messages[{i}].content: expected a string or a list of text parts, got {_short(content)}", "messages")
