"""The MongoDB trajectory store: document models, atomic operations, the embedded server (docs/data-model.md)."""

from agentrl.store.connection import database_name, resolve_connection_string, sync_client, with_database
from agentrl.store.errors import (
    DatabaseUnreachable,
    InvalidTransition,
    LeaseLost,
    NotFound,
    StoreError,
    VersionConflict,
)
from agentrl.store.models import (
    CallStatus,
    DBRecordData,
    DispatchedSamplingTask,
    InferenceService,
    Metric,
    Record,
    RecordStatus,
    Run,
    RunStatus,
    SampleStatus,
    ServiceStatus,
    Task,
    TaskStatus,
)
from agentrl.store.slots import GroupLease, SamplingLoad, SlotLease
from agentrl.store.store import Store

__all__ = [
    "CallStatus", "DatabaseUnreachable", "DBRecordData", "DispatchedSamplingTask", "GroupLease", "InferenceService",
    "InvalidTransition",
    "LeaseLost", "Metric", "NotFound", "Record", "RecordStatus", "Run", "RunStatus", "SampleStatus",
    "SamplingLoad", "ServiceStatus", "SlotLease", "Store", "StoreError", "Task", "TaskStatus", "database_name",
    "VersionConflict", "resolve_connection_string", "sync_client", "with_database",
]
