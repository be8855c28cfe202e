"""``PartField``: a strategy attribute kept on one of the parts the strategy holds, so the strategy's
attributes (``strategy.outer``, ``strategy.plan``, ...) stay as they were while the state lives in
the part (``strategy.diloco_sync.outer``)."""

from __future__ import annotations

from typing import Any, Generic, Optional, TypeVar

T = TypeVar("T")


class PartField(Generic[T]):
    """``strategy.<name>`` reads and writes ``strategy.<part>.<attr>`` (``attr``: the same name)."""

    def __init__(self, part: str, attr: Optional[str] = None) -> None:
        self.part = part
        self.attr = attr

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = self.attr or name

    def __get__(self, obj: Any, owner: Optional[type] = None) -> T:
        if obj is None:  # on the class: the field itself
            return self  # type: ignore[return-value]
        return getattr(getattr(obj, self.part), self.attr)  # type: ignore[arg-type]

    def __set__(self, obj: Any, value: T) -> None:
        setattr(getattr(obj, self.part), self.attr, value)  # type: ignore[arg-type]
