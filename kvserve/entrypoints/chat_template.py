"""Chat templates: the model's own (its tokenizer config, or a GGUF's ``tokenizer.chat_template``
metadata, kept by the conversion), or one the user gives (``--chat-template``, a request's
``chat_template``), plus the extra variables a request passes to it (``chat_template_kwargs``).

Templates are Jinja2, rendered by transformers' ``apply_chat_template`` in its sandboxed
environment; a given template is compiled here first, so a syntax error is reported once, naming
where the template came from, instead of failing every chat.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

#: Longest template accepted, in characters (the models' own are a few KiB).
MAX_CHAT_TEMPLATE_CHARS = 1 << 20


def check_chat_template(text: str, where: str) -> str:
    """``text`` if it compiles as a Jinja2 template.

    Raises:
        ValueError: naming ``where``: an empty or over-long (``MAX_CHAT_TEMPLATE_CHARS``)
            template, or a Jinja2 syntax error (with its line).
    """
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not text.strip():
        raise ValueError(f"{where}: the chat template is empty")
    if len(text) > MAX_CHAT_TEMPLATE_CHARS:
        raise ValueError(
            f"{where}: the chat template has {len(text)} characters, more than {MAX_CHAT_TEMPLATE_CHARS}"
        )
    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as e:
        raise ValueError(
            f"{where}: the chat template is not valid Jinja2 (line {e.lineno}): {e.message}"
        ) from None
    return text


def load_chat_template(value: str, where: str = "--chat-template") -> str:
    """The template ``value`` names: the contents of a file at that path, else ``value`` itself
    when it reads as an inline Jinja2 template (it has ``{{`` or ``{%``), checked by
    ``check_chat_template``.

    Raises:
        ValueError: naming ``where``: neither an existing file nor inline Jinja2, an unreadable
            file, or a template ``check_chat_template`` refuses.
    """
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # e.g. an inline template too long to be a path
        is_file = False
    if is_file:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{where}: cannot read {str(path)!r}: {e}") from None
        return check_chat_template(text, f"{where} {str(path)!r}")
    if "{{" in value or "{%" in value:
        return check_chat_template(value, where)
    raise ValueError(
        f"{where}: {value[:200]!r} is neither a file nor an inline Jinja2 template (one with '{{{{' or '{{%')"
    )


def _reserved_names() -> frozenset[str]:
    """Names a request's ``chat_template_kwargs`` may not use: ``apply_chat_template``'s own
    parameters (they would change how it renders or what it returns, not the template's input)
    and the variables it sets itself."""
    from transformers import PreTrainedTokenizerBase

    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    own = {n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD and n != "self"}
    return frozenset(own | {"messages"})


def check_template_kwargs(kwargs: dict[str, Any] | None, where: str) -> dict[str, Any]:
    """``kwargs`` (a request's extra template variables, e.g. ``{"enable_thinking": false}``) if
    none of its names is reserved (``_reserved_names``); ``{}`` for ``None``.

    Raises:
        ValueError: naming ``where`` and the first reserved key.
    """
    if not kwargs:
        return {}
    reserved = _reserved_names()
    bad = sorted(k for k in kwargs if k in reserved)
    if bad:
        raise ValueError(
            f"{where}.{bad[0]}: {bad[0]!r} is set by the server, not by the template's variables "
            f"(reserved: {', '.join(sorted(reserved))})"
        )
    return dict(kwargs)
