"""Warnings jaxfuse gives once per process: the same message again (the same tree, the same step
lowered again, the same install problem) says nothing new."""

from __future__ import annotations

import warnings

_said: set[str] = set()


def warn_once(message: str, category: type[Warning] = UserWarning, stacklevel: int = 2) -> None:
  """``warnings.warn(message, category)`` unless this process has said `message` already;
  `stacklevel` counts from the caller, as warnings.warn's does."""
  if message not in _said:
    _said.add(message)
    warnings.warn(message, category, stacklevel=stacklevel + 1)


def forget() -> None:
  """Lets every message be said again (for tests that expect a warning)."""
  _said.clear()
