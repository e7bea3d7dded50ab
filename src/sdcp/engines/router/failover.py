"""SDCP 6.9 verifier failure, as the router handles it: fence the session's log above every epoch
it holds, naming the next verifier; replay the log; open the session there with the committed
prefix (and the target KV the failed verifier published, where the MLC holds it); reassign."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from sdcp.cache import MLC, CacheError, target_kv_uri
from sdcp.engines.errors import Unanswered
from sdcp.engines.ports import RouterLink
from sdcp.engines.router.assign import Assignments
from sdcp.engines.router.logs import SessionLogs
from sdcp.engines.router.observe import RouterMetrics
from sdcp.engines.router.placement import Placement
from sdcp.engines.router.sessions import TrackedSession
from sdcp.engines.router.store import SessionStore
from sdcp.engines.tasks import BackgroundTasks
from sdcp.protocol.messages import Policy
from sdcp.protocol.router import InstanceRegistry

__all__ = ["Failover"]

log = logging.getLogger("sdcp.router")


class Failover:
    """Moves the router ``uri``'s sessions off failed or stopped verifiers; each move runs under its
    session's lock (the engine holds it) and is retried by the engine's next pass if it fails."""

    def __init__(
        self,
        *,
        uri: str,
        registry: InstanceRegistry,
        clock: Callable[[], float],
        mlc: MLC,
        store: SessionStore,
        link: RouterLink,
        logs: SessionLogs,
        placement: Placement,
        assignments: Assignments,
        tasks: BackgroundTasks,
        metrics: RouterMetrics,
    ) -> None:
        self.uri = uri
        self._registry = registry
        self._clock = clock
        self._mlc = mlc
        self._store = store
        self._link = link
        self._logs = logs
        self._placement = placement
        self._assignments = assignments
        self._tasks = tasks
        self._metrics = metrics

    async def fail_over(self, tracked: TrackedSession, *, stopped_at: int | None = None) -> None:
        """SDCP 6.9 verifier failure: fence, replay the log, resume at another verifier, reassign.

        With ``stopped_at``, the verifier stopped the session at that epoch, fenced by a record
        this router did not write (a second verifier's, or a writer's with access to the store): the
        session opens again above every epoch in the log, at that verifier while it is live. Without,
        a move whose fence is in the log but whose open failed is finished, even at a live verifier."""
        plan = tracked.plan
        live = self._registry.is_live(plan.verifier, self._clock())
        if stopped_at is not None:
            if tracked.ended or plan.epoch != stopped_at:
                return  # a fence of this router's moved the session on already: the one it met
        elif live and not tracked.moving:
            return
        # The epoch the failed verifier served, which names the target KV it published; the plan's
        # epoch may move up below, to fence above what the log holds.
        served = plan.epoch
        # A verifier that stopped the session (its append fenced) serves it again at the new epoch.
        verifier = (
            plan.verifier
            if live
            else self._placement.pick_verifier(
                plan.contract, avoid=[plan.verifier], prompt=plan.prompt, tenant=plan.tenant
            )
        )
        named = tracked.failover_to
        if named is not None and named != plan.verifier and self._registry.is_live(named, self._clock()):
            verifier = named
        if verifier is None:
            log.info("%s: session %s waits for a verifier", self.uri, tracked.plan.session.hex())
            return
        if named is not None and named != verifier:
            # The last try's fence named another verifier at the next epoch, and a fence of that
            # epoch again appends nothing: that epoch is spent, the session moves at the one after.
            tracked.plan = plan = replace(plan, epoch=plan.epoch + 1)
        # The fence goes above every epoch in the log, not only above the session's: a record that
        # a second verifier (or anyone with write access to the store) appended at the next epoch
        # would otherwise precede the fence and leave the new verifier's epoch poisoned.
        epoch = (await self._logs.read(tracked)).epoch_to_fence(plan.epoch, verifier)
        if epoch > plan.epoch + 1:
            log.warning(
                "%s: session %s: the log holds epoch %d; fenced at %d", self.uri, plan.session.hex(), epoch - 1, epoch
            )
            tracked.plan = plan = replace(plan, epoch=epoch - 1)
        # SDCP 6.9: the fence comes first, so the old verifier can no longer commit or release output.
        # Fencing the same epoch again appends nothing, so a failover retried next tick is safe. The
        # fence names the new verifier: only its signed records count in the new epoch.
        tracked.fenced(verifier)
        # Durable before the fence: a router that takes the session over retries at that verifier.
        await self._store.save(tracked)
        fence = plan.fence_for_failover(verifier)
        await self._mlc.commit_log(plan.commit_log).fence(fence.epoch, fence.verifier)
        replay, tokens = await self._logs.committed_prefix(tracked)
        published = target_kv_uri(plan.commit_log, plan.session, served)
        moved = plan.fail_over(verifier, replay, tokens, target_kv=await self._available(published))
        with self._placement.prefill_at(verifier, len(tracked.prompt) + len(replay.tokens)) as deadline:
            await self._link.open_session(verifier, moved.open_message(), timeout=deadline)
        tracked.reopened(moved)
        if published is not None:
            # The new verifier has imported it or prefilled: the failed epoch's KV serves no one now.
            self._tasks.spawn(self._discard(published))
        self._metrics.moved(elsewhere=verifier != plan.verifier)
        log.info("%s: session %s moved to %s at epoch %d", self.uri, tracked.plan.session.hex(), verifier, moved.epoch)
        if moved.sampling is not None:
            # The new verifier knows only the contract; the current profile must follow the session.
            await self._assignments.send_policy(
                tracked, Policy(session=moved.session, from_round=replay.round + 1, sampling=moved.sampling)
            )
        drafter = moved.drafter
        if drafter is not None and self._registry.is_live(drafter, self._clock()):
            try:
                await self._assignments.send_assignment(tracked, drafter, exploring=tracked.exploring == drafter)
                return
            except Unanswered as exc:
                log.warning("%s: drafter %s took no assignment: %s", self.uri, drafter, exc)
        await self._assignments.assign_drafter(tracked, avoid=(drafter,) if drafter else ())

    async def _available(self, uri: str | None) -> str | None:
        """``uri`` if the MLC holds it: the target KV the failed verifier published (SDCP 6.9)."""
        if uri is None:
            return None
        try:
            return uri if await self._mlc.exists(uri) else None
        except CacheError as exc:
            log.info("%s: target KV %s not looked up, the new verifier prefills: %s", self.uri, uri, exc)
            return None

    async def _discard(self, uri: str) -> None:
        try:
            await self._mlc.delete(uri)
        except CacheError as exc:
            log.info("%s: target KV %s not deleted: %s", self.uri, uri, exc)
