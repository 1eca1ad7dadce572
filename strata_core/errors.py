"""Exceptions Strata raises for problems a user can fix.

Every error carries a message that names what is wrong (the file, the tensor, the option, the
device) and, where it helps, what would be right. The CLI prints ``str(error)`` without a
traceback and exits non-zero; the server maps them to 4xx responses.
"""

from pydantic import ValidationError


class StrataError(Exception):
    """Base class of every user-facing Strata error."""


class ModelFileError(StrataError):
    """A GGUF file is missing, truncated, foreign, or lacks or misshapes a tensor."""


class UnsupportedError(StrataError):
    """An architecture, block format or feature Strata does not implement."""


class ConfigError(StrataError):
    """A setting, strategy name, device or option is invalid."""


class BudgetError(StrataError):
    """A memory budget cannot hold what it must (dense weights, KV cache, buffers)."""


class RequestError(StrataError):
    """A generation request is invalid (prompt too long for the context, bad parameters)."""


class InvalidParamError(RequestError):
    """A request parameter is invalid; ``param`` names it (the server's 400 body carries it)."""

    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class TemplateLimitError(StrataError):
    """The chat template ran past its time or output bound (HTTP 500: the template is the model's)."""


class TemplateCancelled(StrataError):
    """The request went away while its template rendered; the child was stopped."""


#: pydantic's messages for the problems a user makes most, said in the CLI's words
_PROBLEMS = {"missing": "required", "extra_forbidden": "not a known option"}


def one_line(error: Exception, flags: bool = False) -> str:
    """A pydantic or settings error on one line: each problem as ``field: message`` (``--field`` with
    ``flags``: the command-line spelling), any other error's text with its whitespace folded."""
    if not isinstance(error, ValidationError):
        return " ".join(str(error).split())
    by_field: dict[str, list[str]] = {}
    for problem in error.errors():
        names = [str(part) for part in problem["loc"] if str(part).isidentifier()]  # not union tags
        name = names[-1] if names else "value"
        name = "--" + name.replace("_", "-") if flags and names else name
        by_field.setdefault(name, []).append(_PROBLEMS.get(problem["type"], problem["msg"]))
    return "; ".join(f"{name}: {' or '.join(messages)}" for name, messages in by_field.items())
