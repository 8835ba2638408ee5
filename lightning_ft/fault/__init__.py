"""Fault handling: preemption signals, hang watchdog and pre-flight health checks, configured by FaultPolicy."""

from lightning_ft.fault.fault_policy import FaultPolicy

__all__ = ["FaultPolicy"]
