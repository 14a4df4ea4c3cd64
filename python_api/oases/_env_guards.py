"""Guards of `oases env`'s probes (oases.env): a probe that raises becomes one line of text, a
command runs with a time limit and is killed past it; and what the probes share (a command's first
line of output, a distribution's installed version)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import signal
import subprocess
from typing import Any, Callable, Sequence

_ERROR_CHARS = 300


def _guarded(probe: Callable[[], Any]) -> Any:
    """probe(), or "error: Type: message" (one line) if it raises."""
    try:
        return probe()
    except Exception as err:  # noqa: BLE001  (a probe must never end the report)
        return _error_text(err)


def _error_text(err: BaseException) -> str:
    message = " ".join(str(err).split()) or "(no message)"
    if len(message) > _ERROR_CHARS:
        message = message[:_ERROR_CHARS] + "..."
    return f"error: {type(err).__name__}: {message}"


class CommandTimeout(RuntimeError):
    """A command ran past its time limit and was killed."""


def _command(argv: Sequence[str], timeout: float) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `argv`, run in its own session with the C locale.
    Past `timeout` seconds its process group is killed and CommandTimeout raised; FileNotFoundError
    when the program does not exist."""
    env = {**os.environ, "LC_ALL": "C"}
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=2)
        shown = " ".join([os.path.basename(argv[0]), *argv[1:]])
        raise CommandTimeout(f"`{shown}` timed out after {timeout:g} s") from None
    return proc.returncode, out, err


def _first_line(text: str, fallback: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else fallback


def _distribution(*names: str) -> str:
    """The installed version of the first of `names` (distribution names), else "not installed"."""
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return "not installed"
