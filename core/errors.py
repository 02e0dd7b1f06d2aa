"""Typed errors raised by the library. The library never exits; the CLI maps
each error to a one-line message and an exit code (see ``cli/errors.py``).

Every error carries *where*: the model file and, when known, the tensor, the data
file and the byte offset, so the one line a user sees says what is wrong and where.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Named exit codes, shared with the CLI (docs/cli.md, "Exit codes").
EXIT_OK = 0
EXIT_FINDINGS = 1  # a check ran and found problems (preflight; run --compare: a real divergence)
EXIT_UNUSABLE = 2  # the input cannot be used: bad model, bad option, missing file
EXIT_INTERNAL = 3  # a bug: unexpected exception (shown with traceback)
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT), the shell's 128 + 2


def terminal_safe(text: str) -> str:
    """``text`` with every character a terminal would act on (ANSI escapes, newlines,
    NUL, other control and format characters) written as its ``repr``-style escape, so a
    name from a model can neither span lines nor restyle the terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def log_exception(logger: str, message: str, *args) -> None:
    """``logging.getLogger(logger).exception(message, *args)``, from an ``except`` block.
    The runtime logs only the exceptions it swallows (a callback's), so ``logging`` is
    imported when one is logged, not on every run's way to its answer."""
    import logging

    logging.getLogger(logger).exception(message, *args)


@dataclass(frozen=True)
class Where:
    """Location of a problem. Every field is optional; render() joins the known ones."""

    model: str | None = None
    tensor: str | None = None
    file: str | None = None
    offset: int | None = None
    node: str | None = None

    def render(self) -> str:
        parts = []
        if self.model:
            parts.append(f"model {self.model}")
        if self.node:
            parts.append(f"node {self.node!r}")
        if self.tensor:
            parts.append(f"tensor {self.tensor!r}")
        if self.file:
            parts.append(f"file {self.file}")
        if self.offset is not None:
            parts.append(f"offset {self.offset}")
        return ", ".join(parts)


@dataclass
class OnnxPrepError(Exception):
    """Base of every error the library raises on purpose.

    ``message`` says what is wrong, ``where`` where, ``hint`` the next thing to try.
    """

    message: str
    where: Where = field(default_factory=Where)
    hint: str | None = None
    exit_code: int = EXIT_UNUSABLE

    def __post_init__(self) -> None:
        super().__init__(self.one_line())

    def one_line(self) -> str:
        loc = self.where.render()
        text = f"{self.message} ({loc})" if loc else self.message
        if self.hint:
            text += f"; {self.hint}"
        return terminal_safe(text)

    def __str__(self) -> str:  # dataclass would otherwise replace Exception.__str__
        return self.one_line()


class ModelFormatError(OnnxPrepError):
    """The model file is not a valid ONNX protobuf or is structurally inconsistent."""


class ExternalDataError(OnnxPrepError):
    """An external-data reference is missing, out of bounds or malformed."""


class UnsafePathError(ExternalDataError):
    """An external-data location is absolute, escapes the model folder, or is a symlink."""


@dataclass
class DigestError(OnnxPrepError):
    """A declared digest has the wrong form, or a payload does not match its digest
    (then ``expected`` is the declared digest and ``actual`` the bytes' own)."""

    expected: str | None = None
    actual: str | None = None


class UnsupportedOpError(OnnxPrepError):
    """A node has no kernel."""


class NativeError(OnnxPrepError):
    """The native module is missing, stale, or asked for an ISA the CPU lacks."""


class ModelIOError(OnnxPrepError):
    """A model's inputs/outputs could not be interpreted (decoder I/O discovery)."""


class BudgetError(OnnxPrepError):
    """An allocation cannot fit its arena's limit or the global memory budget."""


class TaskFailedError(OnnxPrepError):
    """A runtime task failed; ``__cause__`` holds the original exception."""


class CancelledError(OnnxPrepError):
    """The submission was cancelled before it completed."""


class UsageError(OnnxPrepError):
    """A bad option value or combination."""


class DeviceError(OnnxPrepError):
    """CUDA is not usable (its package, driver or device is missing), a device path this
    build lacks was asked for, or a CUDA driver call failed (core/cuda/)."""


class DeviceBudgetError(BudgetError):
    """A page-in would commit more device memory than the device budget allows."""
