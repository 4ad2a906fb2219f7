"""What the grouper keeps per run (``grouping.Grouper`` decides with it): each condition's ranks and
incidents, the pages, the alerts an inhibitor holds back. Stored in the run-state table's changelog,
so it carries a layout version that a worker of another release reads or refuses, never misreads."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from rankwatch.errors import RankwatchError
from rankwatch.stream_processors import stored

#: Layout of ``RunGroups.to_dict`` (a state stored without a version has version 1's). Raise it when
#: a stored field changes meaning or goes away; one added with a default needs none.
GROUPS_VERSION = 1


class GroupsStateError(RankwatchError, ValueError):
    """Stored alert groups this worker cannot read (another release's layout): never guess at them."""


@dataclass
class Group:
    ranks: list[int] = field(default_factory=list)  # ranks firing now
    touched: list[int] = field(default_factory=list)  # ranks that fired during this incident
    emitted: list[int] = field(default_factory=list)  # ranks in the last emitted firing alert
    pending_since: float | None = None  # wall time the first unsent rank arrived
    pending_step: int = 0  # step of the first unsent rank: the group is due when all ranks pass it
    first: dict | None = None  # the first firing signal of the incident (its alert, as a dict)
    last_seen: dict[str, list] = field(default_factory=dict)  # rank -> [incident, status order]
    urgent: bool = False  # the pending ranks came from the NaN lane: due after ``urgent_wait_s``

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RunGroups:
    world_size: int = 0
    groups: dict[str, Group] = field(default_factory=dict)
    # rank -> last step applied by stage 1. Kept in memory only: it changes with every batch of every
    # rank, and after a restart the next batches rebuild it (a group then waits at most group_wait_s).
    progress: dict[str, int] = field(default_factory=dict)
    # page key -> {"incident", "members", "active", "alert"}: conditions paged together (see the module doc)
    pages: dict[str, dict] = field(default_factory=dict)
    # alert key -> the run-wide alert (as a dict) that an inhibitor holds back while it still fires
    held: dict[str, dict] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"version": GROUPS_VERSION, "world_size": self.world_size,
                "groups": {k: g.to_dict() for k, g in self.groups.items()}, "pages": self.pages, "held": self.held}

    def waiting(self) -> bool:
        return (any(g.pending_since is not None for g in self.groups.values())
                or any(p.get("unsent") for p in self.pages.values()))

    __json__ = to_dict  # Faust's JSON serializer calls this when the table writes its changelog

    @classmethod
    def from_dict(cls, d: dict | None) -> RunGroups:
        """The groups ``to_dict`` stored; GroupsStateError if this worker cannot read them."""
        if not d:
            return cls()
        return stored.read(
            d, lambda f: cls(f["world_size"], {k: Group(**g) for k, g in f["groups"].items()},
                           pages=f.get("pages", {}), held=f.get("held", {})),
            version=GROUPS_VERSION, what="alert groups", error=GroupsStateError)
