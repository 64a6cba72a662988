"""Fault catalogue, fault plans (JSON) and their execution in a target process."""

from fastft.inject.execute import InjectedFault, Injector, StateLostFault, execute
from fastft.inject.plan import FAULT_SEVERITY, FaultKind, FaultPlan, FaultSpec

__all__ = [
    "FAULT_SEVERITY",
    "FaultKind",
    "FaultPlan",
    "FaultSpec",
    "InjectedFault",
    "Injector",
    "StateLostFault",
    "execute",
]
