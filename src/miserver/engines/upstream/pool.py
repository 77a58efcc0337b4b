"""Pools of upstreams (DESIGN §8): upstreams that list the same model id form that model's :class:`UpstreamPool`. A
pool has its own admission gate (:class:`PoolGate`: one slot per ``max_in_flight`` place of its members, interactive
requests first), so the backlog of a batch stays in miServer's durable queue, never in an upstream's memory."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ...scheduling.admission import AdmissionGate
from ..base import EngineInfo
from .client import Upstream

log = logging.getLogger("miserver.upstream")


class PoolGate(AdmissionGate):
    """An admission gate whose slots grow when an upstream joins the pool (its ``max_in_flight`` places)."""

    def add_slots(self, count: int) -> None:
        """``count`` more slots, handed at once to waiters (interactive first)."""
        self.slots += count
        self._free += count
        self._dispatch()


@dataclass
class UpstreamPool:
    """The upstreams serving ``model``. ``info`` is what a resident engine's info is to a resident row: the model id
    requests name, ``backend`` ``upstream:<names>``, the context length (0 when no member says it)."""

    model: str
    members: list[Upstream] = field(default_factory=list)
    gate: PoolGate = field(default_factory=lambda: PoolGate(1))
    _sized: bool = False

    @property
    def info(self) -> EngineInfo:
        lengths = [m.context_length for u in self.members for m in u.models if m.id == self.model and m.context_length]
        names = ",".join(u.name for u in self.members)
        return EngineInfo(
            model_id=self.model,
            backend=f"upstream:{names}",
            dtype="",
            weights_revision="",
            context_length=min(lengths) if lengths else 0,
        )

    def serving(self, upstream: Upstream) -> bool:
        """Whether ``upstream`` can take this pool's rows now: it answered its last probe (and no request to it
        failed since) and its last listing still names the model. A member that answers again but no longer lists
        the model (restarted with another model, or its port taken by another server) is left out: sent there, a
        row would get that server's 404 as its own error."""
        return upstream.live and any(m.id == self.model for m in upstream.models)

    @property
    def live(self) -> bool:
        """Whether a member serves the model now (:meth:`serving`)."""
        return any(self.serving(u) for u in self.members)

    def join(self, upstream: Upstream) -> None:
        """Add ``upstream`` (once) and its places to the gate."""
        if upstream in self.members:
            return
        self.members.append(upstream)
        if not self._sized:  # the gate was made with one slot before any member was known
            self._sized = True
            self.gate.add_slots(upstream.config.max_in_flight - 1)
        else:
            self.gate.add_slots(upstream.config.max_in_flight)

    def pick(self, avoid: Upstream | None = None) -> Upstream | None:
        """The serving member (:meth:`serving`) with the most free places (not ``avoid``, the one that just failed,
        while another serves); None when no member serves the model now."""
        live = [u for u in self.members if self.serving(u)]
        others = [u for u in live if u is not avoid] or live
        if not others:
            return None
        return max(others, key=lambda u: (u.config.max_in_flight - u.in_flight) / u.config.max_in_flight)
