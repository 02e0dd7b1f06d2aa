"""The prepared execution plan: tasks, recipes, invocation steps; its report (plan-dump)."""
from onnx_prep.core.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "Arena": "task",
    "TaskDescriptor": "task",
    "TaskId": "task",
    "TaskScope": "task",
    "TaskKind": "task",
    "ResourceClass": "task",
    "Priority": "task",
    "PreparedExecutionPlan": "execution_plan",
    "build_prepared_execution_plan": "execution_plan",
    "MaterializationRecipe": "execution_plan",
    "PreparedRequirement": "execution_plan",
    "InvocationStep": "execution_plan",
    "LookaheadWindow": "execution_plan",
    "PackedPayloadEntry": "execution_plan",
    "PackedPayloadIndex": "execution_plan",
    "task_to_json": "execution_plan",
    "DeviceTarget": "device_target",
    "CostModel": "plan_report",
    "plan_dump": "plan_report",
    "plan_report": "plan_report",
    "plan_dot": "plan_report",
    "task_from_json": "plan_report",
})
