"""What one JSON field of a request may hold: checks that raise OpenAI's error JSON.

Every check names the field (`param`) it refused, so a client learns which one was wrong:
`APIError` is answered as HTTP `status` with {"error": {message, type, param, code}}.
"""

from __future__ import annotations

import math

from branchspec.config import MAX_SEED

MAX_STOP_STRINGS = 16    # each one is searched after every token


class APIError(Exception):
    """An error answered with OpenAI's JSON: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, *,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None, status_label: str = "invalid"):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type, self.code, self.headers = type, code, headers or {}
        self.status_label = status_label   # the `status` label of the requests metric

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_JSON_NAMES = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
               float: "number", type(None): "null"}


def what(value) -> str:
    """A value as the error message shows it: its JSON type and (the start of) its text."""
    text = repr(value)
    return f"{_JSON_NAMES.get(type(value), type(value).__name__)} {text if len(text) <= 40 else text[:37] + '...'}"


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param} {message}", param)


def integer(param: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        hint = f"; write {int(value)}" if isinstance(value, float) and value.is_integer() else ""
        raise bad(param, f"must be an integer, got {what(value)}{hint}")
    if minimum is not None and value < minimum:
        raise bad(param, f"must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise bad(param, f"must be <= {maximum}, got {value}")
    return value


def number(param: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(param, f"must be a number, got {what(value)}")
    try:
        value = float(value)
    except OverflowError:
        raise bad(param, "must be a finite number, got an integer too large for a float") from None
    if not math.isfinite(value):   # json.loads accepts NaN and Infinity
        raise bad(param, f"must be a finite number, got {value}")
    return value


def boolean(param: str, value) -> bool:
    if not isinstance(value, bool):
        raise bad(param, f"must be true or false, got {what(value)}")
    return value


def text(param: str, value, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise bad(param, f"must be a string, got {what(value)}")
    if not value and not allow_empty:
        raise bad(param, "is empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:   # a lone surrogate, e.g. "\ud800" in the JSON
        raise bad(param, f"cannot be encoded as UTF-8 ({e.reason} at character {e.start})") from None
    return value


def get(body: dict, name: str, check, *args, default=None):
    """body[name] checked, or `default` when absent or null."""
    value = body.get(name)
    return default if value is None else check(name, value, *args)


def only_default(body: dict, name: str, allowed: tuple, why: str) -> None:
    """Parameters we accept only at their no-op value."""
    value = body.get(name)
    if value is not None and not any(value == a and type(value) is type(a) for a in allowed):
        raise APIError(400, f"{name} is not supported by this server ({why}), got {what(value)}", name)


def seed(param: str, value) -> int:
    return integer(param, value, 0, MAX_SEED)


def stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        raise bad("stop", f"must be a string or an array of strings, got {what(stop)}")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad("stop", f"may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    return tuple(text(f"stop[{i}]", s) for i, s in enumerate(stop))


def token_ids(param: str, value) -> list[int]:
    """An array of token ids (each checked against the vocabulary later, by the engine)."""
    if not isinstance(value, list):
        raise bad(param, f"must be an array of token ids, got {what(value)}")
    return [integer(f"{param}[{i}]", t, 0) for i, t in enumerate(value)]


def logit_bias(param: str, value) -> dict[int, float]:
    """OpenAI's {"token id": bias} (keys are strings in JSON), biases in [-100, 100]."""
    if not isinstance(value, dict):
        raise bad(param, f"must be an object mapping token ids to biases, got {what(value)}")
    out, keys = {}, {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise bad(param, f"keys must be token ids (non-negative integers), got {what(key)}")
        b = number(f"{param}.{key}", bias)
        if not -100.0 <= b <= 100.0:
            raise bad(f"{param}.{key}", f"must be in [-100, 100], got {b:g}")
        token = int(key)
        if token in out:   # "0408" and "408": one of the two would silently win
            raise bad(param, f"gives token {token} twice (keys {keys[token]!r} and {key!r}); give each token once")
        out[token], keys[token] = b, key
    return out
