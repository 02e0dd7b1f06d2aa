"""The runtime: scheduler, prepared-object store, arenas, handles, sessions."""
from onnx_prep.core.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "Session": "session",
    "RuntimeContext": "session",
    "Workspace": "session",
    "SessionCounters": "session",
    "Scheduler": "scheduler",
    "TaskHandle": "scheduler",
    "TaskContext": "scheduler",
    "TaskState": "scheduler",
    "CancelToken": "scheduler",
    "PreparedObjectStore": "prepared_store",
    "ResidencyState": "prepared_store",
    "PreparedStateError": "prepared_store",
    "MemoryBudget": "arenas",
    "Arena": "arenas",
    "ArenaStats": "arenas",
    "BudgetSnapshot": "arenas",
    "Reservation": "arenas",
    "ExecutionHandle": "execution_handle",
    "ExecutionStatus": "execution_handle",
    "SubmissionState": "execution_handle",
    "ActionProgram": "action_program",
    "direct_replay": "action_program",
})
