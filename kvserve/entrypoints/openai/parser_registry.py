"""A registry of output parsers by name (the tool-call and reasoning parsers each keep one)."""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar


class _Named(Protocol):
    name: str


P = TypeVar("P", bound=_Named)


class ParserRegistry(Generic[P]):
    """Parser classes by their ``name``; ``kind`` names them in errors (``"tool-call parser"``)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._classes: dict[str, type[P]] = {}

    def register(self, cls: type[P]) -> type[P]:
        """Make ``cls`` available as ``get(cls.name)``."""
        self._classes[cls.name] = cls
        return cls

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._classes)

    def get(self, name: str) -> type[P]:
        """The parser class called ``name``.

        Raises:
            ValueError: ``name`` is not registered (the message lists the known names).
        """
        try:
            return self._classes[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}.") from None
