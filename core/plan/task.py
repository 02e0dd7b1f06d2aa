"""Task descriptors: the immutable vocabulary of the prepared execution plan.

The plan (``core/plan/execution_plan.py``) is ONE immutable graph of :class:`TaskDescriptor`\\ s. A
descriptor says *what* a task is (kind, scope, resource class, dependencies, the
prepared objects it consumes and publishes, its byte estimates); it holds no mutable
state. Runtime state (completion, errors, residency, allocations) lives in the
scheduler's ``TaskHandle``\\ s, the ``PreparedObjectStore`` and the session, never here.

Contract (stable; the plan builder and the session both rely on it):

- ``TaskDescriptor`` is frozen, hashable and validated at construction: a non-empty
  ``id``, no self-dependency, no duplicate dependencies, non-negative byte estimates,
  an ``action_range`` only on ``INVOCATION`` tasks with ``0 <= begin <= end``.
- ``dependencies`` are task ids *within the same plan*; edges from an invocation task to
  a session task are bound to the current session-task generation at submission time
  (docs/design.md, "Plan template and inference submissions"), not here.
- :meth:`TaskDescriptor.memory_request` is the default translation of the byte estimates
  into a scheduler memory request (``{Arena: bytes}``); see its docstring.

Constructing descriptors never does I/O and never touches the scheduler.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from onnx_prep.core.model.prepared_key import PreparedKey

__all__ = ["Arena", "TaskId", "TaskScope", "TaskKind", "ResourceClass", "Priority", "TaskDescriptor"]

TaskId = str


class Arena(enum.Enum):
    """The memory arenas a task's bytes are admitted against (the runtime's budget keeps them)."""

    PREPARATION = "preparation"
    PREPARED = "prepared"
    EXECUTION = "execution"
    IO = "io"


class TaskScope(enum.Enum):
    """Lifetime of a task's state (docs/design.md, "One scoped execution plan")."""

    SESSION = "session"  # produces prepared objects; shared by every invocation; runs once per generation
    INVOCATION = "invocation"  # consumes caller inputs; instantiated afresh for every run


class TaskKind(enum.Enum):
    """What a task does. The kind never changes scheduling by itself; ``resource`` does."""

    READ_SOURCE = "read_source"  # read source payload bytes through the one external-data reader
    READ_PACKED = "read_packed"  # read a persisted prepared payload (cache tier)
    PREPACK = "prepack"  # transform source bytes into a kernel's packed layout
    PERSIST = "persist"  # write a prepared payload to the cache tier (background)
    UPLOAD = "upload"  # copy a prepared object to an accelerator
    CONSTANT = "constant"  # compute a small constant (folded value) once per session
    EXECUTE = "execute"  # run a contiguous range of the invocation's action list
    RELEASE = "release"  # return invocation-owned buffers (usually folded into EXECUTE)


class ResourceClass(enum.Enum):
    """Which queue runs the task (docs/design.md, "Task resources and scheduling")."""

    IO = "io"  # bounded I/O workers: blocking reads/writes never occupy CPU workers
    MAPPED = "mapped"  # a persisted payload mapped into its slot: page-table work and a
    #                    checksum on the page cache, no storage read to share (own workers)
    CPU = "cpu"  # transforms, prepacking, CPU kernels
    DEVICE = "device"  # one queue per accelerator stream
    INLINE = "inline"  # trivial work: runs on the thread that made it ready


class Priority(enum.IntEnum):
    """Priority classes; lower value runs first. Within a class, submission order (FIFO)."""

    CRITICAL = 0  # inference and the producer chain an inference is waiting on
    DEMANDED = 1  # work that is wanted, not speculative: what a caller blocks on through
    #             a handle's wait() (e.g. prepare()), and what an in-flight run will
    #             consume within its look-ahead window. Queued after CRITICAL, but may
    #             use every worker (see scheduler.py).
    PREFETCH = 2  # preparation inside the look-ahead window
    BACKGROUND = 3  # preparation outside the window, cache writes, optional variants


@dataclass(frozen=True, slots=True)
class TaskDescriptor:
    """One node of the immutable plan graph.

    ``arena`` is where the task's *output* lives (e.g. ``PREPARATION`` for a source read,
    ``PREPARED`` for a prepack, ``EXECUTION``/``IO`` for invocation outputs), or ``None``
    when the task produces nothing that occupies host memory (an upload or a device
    prepack fills a device slot: the device slot pool's memory, not an arena's). ``action_range`` is the
    half-open range ``[begin, end)`` of the invocation action list that an ``EXECUTE``
    task replays.
    """

    id: TaskId
    scope: TaskScope
    kind: TaskKind
    resource: ResourceClass
    dependencies: tuple[TaskId, ...] = ()
    prepared_requirements: tuple[PreparedKey, ...] = ()
    publishes: PreparedKey | None = None
    estimated_input_bytes: int = 0
    estimated_output_bytes: int = 0
    peak_temporary_bytes: int = 0
    arena: Arena | None = None
    action_range: tuple[int, int] | None = None
    label: str = ""

    def __post_init__(self) -> None:
        # NOTE: validation here, not in the plan builder, so every producer of descriptors
        # (tests, future planners) gets the same guarantees.
        if not isinstance(self.id, str) or not self.id:
            raise ValueError("TaskDescriptor.id must be a non-empty string")
        deps = tuple(self.dependencies)
        reqs = tuple(self.prepared_requirements)
        object.__setattr__(self, "dependencies", deps)
        object.__setattr__(self, "prepared_requirements", reqs)
        if self.id in deps:
            raise ValueError(f"task {self.id!r} depends on itself")
        if len(set(deps)) != len(deps):
            raise ValueError(f"task {self.id!r} lists a dependency twice: {deps}")
        for name in ("estimated_input_bytes", "estimated_output_bytes", "peak_temporary_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"task {self.id!r}: {name} must be a non-negative int, got {value!r}")
        if self.action_range is not None:
            if self.scope is not TaskScope.INVOCATION:
                raise ValueError(f"task {self.id!r}: action_range is only valid on invocation tasks")
            begin, end = self.action_range
            if not (0 <= begin <= end):
                raise ValueError(f"task {self.id!r}: bad action_range {self.action_range}")
            object.__setattr__(self, "action_range", (int(begin), int(end)))
        if self.publishes is not None and self.scope is not TaskScope.SESSION:
            raise ValueError(f"task {self.id!r}: only session tasks publish prepared objects")

    @property
    def scratch_arena(self) -> Arena:
        """Arena of the task's temporaries: Preparation for session tasks, Execution for invocation tasks."""
        return Arena.PREPARATION if self.scope is TaskScope.SESSION else Arena.EXECUTION

    def memory_request(self) -> dict[Arena, int]:
        """Default memory to reserve before dispatch: ``{arena: bytes}``, zero entries omitted.

        Output bytes go to ``self.arena``; ``peak_temporary_bytes`` to :attr:`scratch_arena`.
        Input bytes are NOT reserved: the producer's reservation already covers them
        (a producer hands its output reservation on via ``TaskContext.detach``).
        """
        request: dict[Arena, int] = {}
        if self.arena is not None and self.estimated_output_bytes:
            request[self.arena] = self.estimated_output_bytes
        if self.peak_temporary_bytes:
            scratch = self.scratch_arena
            request[scratch] = request.get(scratch, 0) + self.peak_temporary_bytes
        return request
