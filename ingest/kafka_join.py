"""A consumer that finishes every group join it starts (kafka-python 3.0.12's join race).

kafka-python 3.0.12 joins a group on its IO thread: ``poll`` schedules one JoinGroup and
SyncGroup round trip as a task and waits for it for as long as its own timeout allows;
only the thread that calls ``poll`` finishes the join (the member becomes stable, its
heartbeat is switched back on, the rebalance listener hears the new assignment). When the
task ends between two polls, that work is done by the next poll, if the next poll still
sees a rejoin as needed. Two ways it does not:

- **The join is never finished.** A leader that rejoins because the topics' metadata
  changed (a subscribed topic was created, or got partitions) makes the new assignment
  inside the task, which makes its metadata and assignment snapshots agree: the next poll
  sees no rejoin needed and returns. The member stays rebalancing with its heartbeat off,
  for good: the broker drops it after the session timeout, every commit fails with
  ``RebalanceInProgressError``, and it reads nothing until restarted. Measured on the real
  broker: 1 ingest process in 7 of the rebalance test, the other member took over.
- **A finished join is thrown away.** A task that ended is replaced by a new JoinGroup
  instead of being read: another rebalance of the whole group, and a member busy between
  its polls may never join at all (``tests/test_kafka_join.py``, case "first").

:func:`guard_join` gives that consumer (and no other) a ``need_rejoin`` that counts a
scheduled join as pending until its result is read, so that ``poll`` goes on to the join
loop, and a join loop that reads a finished join instead of starting another: Kafka's own
consumer's rule (a rejoin is needed or pending). A join that failed is never read twice:
it is retried (after kafka-python's backoff when retriable) or raised out of one poll.
Everything else is kafka-python's own (its join and sync requests, their error handling,
the rebalance listener). It is applied only where the join loop is the one described
(:data:`AFFECTED`); on another kafka-python the consumer is left as it is and
``tests/test_kafka_join.py`` says whether that version has the race.
"""

from __future__ import annotations

import logging
import types
from typing import Any

log = logging.getLogger(__name__)

# the kafka-python releases whose join loop this replaces (read from their source)
AFFECTED = frozenset({"3.0.12"})

# what the replacement calls on the coordinator: all of it must be there
_NEEDS = (
    "_join_task",
    "rejoining",
    "_do_join_and_sync_async",
    "_on_join_prepare_async",
    "_on_join_complete_async",
    "_disable_heartbeat",
    "_enable_heartbeat",
    "ensure_coordinator_ready_async",
    "need_rejoin",
    "_manager",
    "_generation",
    "_lock",
    "config",
)


def guard_join(consumer: Any) -> bool:
    """Gives ``consumer`` the join loop that reads every join it starts. Returns whether it
    was applied (not on an unaffected kafka-python, nor on a consumer without a group)."""
    import kafka

    coordinator = getattr(consumer, "_coordinator", None)
    if kafka.__version__ not in AFFECTED or coordinator is None:
        return False
    missing = [name for name in _NEEDS if not hasattr(coordinator, name)]
    if missing:  # the same version number with another join loop: leave it alone, say so
        log.warning("kafka-python %s lacks %s: its group join is left as it is", kafka.__version__, missing)
        return False
    rejoin_needed_or_not = coordinator.need_rejoin

    def need_rejoin() -> bool:  # what ``poll`` asks before it joins: a join still unread counts
        return coordinator._join_task is not None or bool(rejoin_needed_or_not())

    coordinator.need_rejoin = need_rejoin
    coordinator.join_group_async = types.MethodType(_join_group_async, coordinator)
    return True


async def _join_group_async(self: Any, timeout_ms: float | None = None) -> bool:
    """Until joined: True; False when ``timeout_ms`` ends first, the join still pending
    (the next poll waits for it, or reads it if it has ended meanwhile)."""
    from kafka import errors
    from kafka.structs import MemberState
    from kafka.util import Timer

    timer = Timer(timeout_ms)
    while self.need_rejoin():  # (guard_join's: a join scheduled and not yet read counts)
        if not await self.ensure_coordinator_ready_async(timeout_ms=timer.timeout_ms):
            return False
        if self._join_task is None:
            if not self.rejoining:  # once per rebalance: the listener hears the revocation once
                await self._on_join_prepare_async(
                    self._generation.generation_id, self._generation.member_id, timeout_ms=timer.timeout_ms
                )
                self.rejoining = True
                self._disable_heartbeat()  # after the listener: heartbeats flow while it runs
            self._join_task = self._manager.call_soon(self._do_join_and_sync_async)
        try:
            # a task that has ended gives its result (or raises its error) at once
            assignment = await self._manager.wait_for(self._join_task, timer.timeout_ms)
        except errors.KafkaTimeoutError:
            if not self._join_task.is_done:
                return False  # still in flight: awaited by the next poll, never sent twice
            if self._join_task.succeeded():
                continue  # it ended as the time did: read it now
            # the task's own timeout (a request that could not be sent in time): retriable,
            # never read again (that would raise it again at once, the IO thread spinning)
            self._join_task = None
            if not await _back_off(self, timer):
                return False
            continue
        except (
            errors.UnknownMemberIdError,
            errors.RebalanceInProgressError,
            errors.IllegalGenerationError,
            errors.MemberIdRequiredError,
        ):
            self._join_task = None  # the response handlers reset what must be: join again now
            continue
        except errors.RetriableError:
            self._join_task = None
            if not await _back_off(self, timer):
                return False
            continue
        except Exception:  # non-retriable, or an assignor's: raised once, the next poll joins anew
            self._join_task = None
            raise
        self._join_task = None
        with self._lock:
            self.rejoining = False
            self.rejoin_needed = False
            self.state = MemberState.STABLE
            self._enable_heartbeat()
        generation = self._generation
        await self._on_join_complete_async(
            generation.generation_id, generation.member_id, generation.protocol, assignment
        )
        return True
    return True


async def _back_off(self: Any, timer: Any) -> bool:
    """kafka-python's pause before a retriable join failure is retried; False: no time left."""
    if timer.expired:
        return False
    backoff_ms = self.config["retry_backoff_ms"]
    if timer.timeout_ms is not None:
        backoff_ms = min(backoff_ms, timer.timeout_ms)
    if backoff_ms > 0:
        await self._manager._net.sleep(backoff_ms / 1000)
    return True
