"""``FieldError``: the error of one named argument or request field. No JAX here.

The library's checks raise it where one argument is at fault (``SamplingParams``, the
engine's admission of a request, a tool definition), so a caller that must say which
field was wrong (the server's 400 answers, with OpenAI's ``param``) reads ``field``
instead of taking the message apart."""

from __future__ import annotations


class FieldError(ValueError):
    """A ``ValueError`` about argument ``field``; its message is ``"{field}: {problem}"``.

    ``field`` is the argument's name as the raising API spells it (``"top_p"``,
    ``"params.stop"``, ``"messages[2].role"``); several names, comma-separated, where
    only their combination is wrong."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem

    def __reduce__(self):  # (pickled with its field: it may cross processes)
        return _rebuilt, (self.field, self.problem, self.args)


def _rebuilt(field: str, problem: str, args: tuple) -> FieldError:
    e = FieldError(field, problem)
    e.args = args
    return e


def with_context(e: Exception, where: str) -> Exception:
    """``e`` again (its type, and a ``FieldError``'s field), its message led by
    ``where``: ``prompts[3]: top_p: expected ...`` for the fourth of several requests."""
    if isinstance(e, FieldError):
        return _rebuilt(e.field, e.problem, (f"{where}: {e}",))
    return type(e)(f"{where}: {e}")
