"""Pure placement planning: `plan(cfg) -> Plan` (which ranks, nodes, devices and layout each group gets)."""
from yatt_hpc.placement.plan import GROUPS, GroupPlan, Plan, PlanError, SlurmShape, plan

__all__ = ["GROUPS", "GroupPlan", "Plan", "PlanError", "SlurmShape", "plan"]
