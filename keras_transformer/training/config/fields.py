"""The pieces every config component is made of: a field with its flag's help, check and
choices (`setting`), and the checks of one value shared by the flags' parsing and by configs
built in Python."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any


def positive(value: float) -> str | None:
    """None if `value` is a positive finite number, else what is wrong."""
    return None if value > 0 and math.isfinite(value) else "must be positive"


def non_negative(value: float) -> str | None:
    return None if value >= 0 and math.isfinite(value) else "must be >= 0"


def fraction(value: float) -> str | None:
    return None if 0.0 <= value < 1.0 else "must be in [0, 1)"


def setting(default: Any = dataclasses.MISSING, help: str = "", check: Callable | None = None,
            choices: tuple | None = None) -> Any:
    """A config field with what its flag needs: help text, a value check, choices."""
    metadata = {"help": help, "check": check, "choices": choices}
    return dataclasses.field(default=default, metadata=metadata)


def comma_separated(text: str, kind: type) -> list:
    """``"4,6"`` -> ``[4, 6]`` (``""`` -> ``[]``); ValueError for an item that is no `kind`."""
    return [kind(item) for item in text.split(",")] if text else []


def each(kind: type, check: Callable, description: str) -> Callable[[str], str | None]:
    """The check of a comma-separated list whose every item passes `check`."""
    def check_list(text: str) -> str | None:
        try:
            if not any(check(value) for value in comma_separated(text, kind)):
                return None
        except ValueError:
            pass
        return f"must be comma-separated {description}"
    return check_list


int_list = each(int, positive, "whole numbers >= 1, e.g. 4,6")
float_list = each(float, non_negative, "numbers >= 0, e.g. 0.6,1.0,1.4")
