"""The KV store's metadata master (docs/kvstore.md): pure core, durable journal, leader election.

`core.MasterCore` decides (allocation, two-phase puts, leases, eviction, nodes); `journal` makes
its records durable (files or Redis); `election` picks one leader among HA masters. Must not
import `pdserve.engine` or move object bytes: the master holds metadata only.
"""

from pdserve.kvstore.master.config import ConfigError, MasterConfig
from pdserve.kvstore.master.core import MasterCore
from pdserve.kvstore.master.election import LeaderElection
from pdserve.kvstore.master.journal import FileJournal, Journal, JournalError, RedisJournal
from pdserve.kvstore.master.model import (
    TIERS, AlreadyExists, ClusterIdConflict, Demotion, Event, EventsLost, InvalidArgument, MasterError, NoSpace,
    NotFound, ObjectInfo, Placement, PutInProgress, Record, RestoreError, SegmentSpec, TierStats,
    UnknownNode,
)

__all__ = [
    "TIERS", "AlreadyExists", "ClusterIdConflict", "ConfigError", "Demotion", "Event", "EventsLost", "FileJournal",
    "InvalidArgument", "Journal", "JournalError", "LeaderElection", "MasterConfig", "MasterCore",
    "MasterError", "NoSpace", "NotFound", "ObjectInfo", "Placement", "PutInProgress", "Record",
    "RedisJournal", "RestoreError", "SegmentSpec", "TierStats", "UnknownNode",
]
