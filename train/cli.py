"""What every command line of the trainer does with an error: one ``error:`` line and a documented exit code.

``train.main``, ``train.hf``, ``train.generate``, ``train.data`` and ``train.plot`` end in
:func:`run` (``raise SystemExit(cli.run(main))``; ``train.main``, an absl program, formats its
errors with :func:`one_line` and :func:`exit_code`). A user mistake (a missing or unreadable file,
a bad argument, a malformed config, token or weight file, a corrupt checkpoint) prints one line,
``error: <what was wrong, naming the file, and what to do>``, and exits 2; the traceback is printed
only with ``--debug`` (``-v``), or absl's ``--verbosity`` for ``train.main``. Anything else is a bug:
the same one line with the exception's type, exit 1.

Code that finds a user mistake raises :class:`UserError` (or a ``ValueError`` / ``OSError``, which
count as one: the trainer's own ``ValueError`` messages say what to change, and an ``OSError``
names its file).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

EXIT_ERROR = 1  # a bug: please report it with the --debug traceback
EXIT_USAGE = 2  # a user mistake
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)
DEBUG_FLAGS = ("--debug", "-v")  # print the traceback too
MAX_MESSAGE = 400  # characters of an error's one line


class UserError(Exception):
  """A mistake the user can fix; the message is one line naming what was wrong (and the file) and what to do."""


# Exceptions that are user mistakes (exit 2) unless a command's own table says otherwise.
USER_ERRORS: tuple[type[BaseException], ...] = (UserError, ValueError, OSError)


def one_line(error: BaseException) -> str:
  """``error`` as one line: an OSError as ``<file>: <reason>``, anything else its message's first line (bugs: with
  their type)."""
  if isinstance(error, OSError) and error.strerror:
    names = [str(n) for n in (error.filename, error.filename2) if n is not None]
    text = f"{' -> '.join(names)}: {error.strerror}" if names else error.strerror
  else:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if not isinstance(error, USER_ERRORS):
      text = f"{type(error).__name__}: {text}" if text else type(error).__name__
  return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."


def exit_code(error: BaseException, codes: Sequence[tuple[type[BaseException], int]] = ()) -> int:
  """The exit code of ``error``: the first of ``codes`` that matches, else 2 for a user mistake, else 1."""
  for kind, code in codes:
    if isinstance(error, kind):
      return code
  return EXIT_USAGE if isinstance(error, USER_ERRORS) else EXIT_ERROR


def run(main: Callable[[list[str]], Any], argv: Sequence[str] | None = None,
        codes: Sequence[tuple[type[BaseException], int]] = ()) -> int:
  """Call ``main(argv)`` (default ``sys.argv[1:]``, less the debug flags) and return its exit code: its return
  value (None: 0), or that of :func:`exit_code` after printing ``error: <one line>`` to stderr."""
  argv = list(sys.argv[1:] if argv is None else argv)
  debug = any(arg in DEBUG_FLAGS for arg in argv)
  argv = [arg for arg in argv if arg not in DEBUG_FLAGS]
  try:
    result = main(argv)
  except KeyboardInterrupt:
    print("error: interrupted", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED
  except Exception as e:  # noqa: BLE001  (every error ends in one line and a documented code)
    code = exit_code(e, codes)
    if debug:
      traceback.print_exc()
    hint = "" if debug or code == EXIT_USAGE else f" (run again with {DEBUG_FLAGS[0]} for the traceback)"
    print(f"error: {one_line(e)}{hint}", file=sys.stderr, flush=True)
    return code
  return 0 if result is None else int(result)


def read_json(path: str | pathlib.Path, what: str = "JSON file", advice: str = "", kind: type = dict) -> Any:
  """The parsed JSON of ``path`` (a ``kind``); UserError naming the file (and ``advice``: what to do) when it is
  missing, unreadable, empty, malformed or not a ``kind``."""
  path = pathlib.Path(path)
  advice = f"; {advice}" if advice else ""
  try:
    text = path.read_text()
  except FileNotFoundError:
    raise UserError(f"{path}: no such {what}{advice}") from None
  except (OSError, UnicodeDecodeError) as e:
    raise UserError(f"{path}: cannot read this {what} ({one_line(e)}){advice}") from None
  if not text.strip():
    raise UserError(f"{path}: the {what} is empty (cut short by a full disk or a kill?){advice}")
  try:
    value = json.loads(text)
  except json.JSONDecodeError as e:
    raise UserError(f"{path}: the {what} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}){advice}") \
        from None
  if not isinstance(value, kind):
    raise UserError(f"{path}: the {what} holds a JSON {type(value).__name__}, not a {kind.__name__}{advice}")
  return value


def check_output_dir(path: str | pathlib.Path, what: str = "--out") -> pathlib.Path:
  """``path`` created as a writable directory; UserError naming it when a file is in the way or it is read-only."""
  path = pathlib.Path(path)
  for parent in (path, *path.parents):
    if parent.exists() and not parent.is_dir():
      raise UserError(f"{what} {path}: {parent} is a file, not a directory; choose another {what}")
    if parent.exists():
      break
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise UserError(f"{what} {path}: cannot create it ({one_line(e)}); choose another {what}") from None
  probe = path / f".jaxlowbit-write-test-{os.getpid()}"
  try:
    probe.write_bytes(b"")
    probe.unlink()
  except OSError as e:
    raise UserError(f"{what} {path}: cannot write there ({one_line(e)}); choose another {what}") from None
  return path


__all__ = ["DEBUG_FLAGS", "EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_USAGE", "USER_ERRORS", "UserError",
           "check_output_dir", "exit_code", "one_line", "read_json", "run"]
