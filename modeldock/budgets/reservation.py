"""One request's reservation in its token and cost budgets, held from admission to its one settlement.

    reservation.prompt, reservation.output   # what was reserved: the prompt estimate, the output limit
    reservation.capped                       # output < what was asked (the budget had room for less)
    reservation.finish_nowait(sent=..., usage=..., backend_error=...)   # the rule: tokens.charge_for
    reservation.charged_usage, reservation.charged, reservation.charged_cost   # once settled

The first of `finish`/`settle`/`refund`/`charge_reserved` decides (before any await); later calls are
no-ops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Literal, Protocol

from modeldock.budgets.lease import TokenLease
from modeldock.budgets.pricing import Price, to_micros
from modeldock.budgets.tokens import Usage, charge_for


class Books(Protocol):
    """Where a reservation settles: its budgets (`TokenBudgets`), named by what it needs so that this
    module does not import the one that makes reservations."""

    def _settle(self, reservation: Reservation, usage: Usage) -> asyncio.Future[None] | None: ...


ReservationState = Literal["held", "settled", "refunded", "charged"]


class Reservation:
    __slots__ = (
        "_budgets", "_entry_id", "_keys", "_lease", "_taken", "_units", "asked", "charged", "charged_cost",
        "charged_usage", "headers", "output", "price", "prompt", "request_id", "state",
    )

    def __init__(
        self,
        budgets: Books | None,
        request_id: str,
        entry_id: str,
        prompt: int,
        output: int,
        keys: list[tuple[str, float]],
        lease: TokenLease | None,
        headers: Mapping[str, str],
        *,
        asked: int | None = None,
        units: Sequence[bool] = (),
        price: Price | None = None,
        taken: int | None = None,
    ) -> None:
        self._budgets = budgets
        self._entry_id = entry_id
        self._keys = keys
        self._lease = lease  # the shared (Redis) lease it was drawn from, if any
        self._taken = prompt + output if taken is None else taken  # tokens drawn from the lease
        self._units = units  # per key: True for a cost budget (millionths), False for tokens
        self.request_id = request_id
        self.prompt = prompt  # the prompt estimate reserved
        self.output = output  # the output limit reserved (all choices): what the forwarded body may carry
        self.asked = output if asked is None else asked  # the output limit the request asked for
        self.price = price
        self.headers: Mapping[str, str] = headers
        self.state: ReservationState = "held"
        self.charged: int | None = None  # tokens finally counted, once settled
        self.charged_usage: Usage | None = None  # what was charged (tokens.charge_for)
        self.charged_cost: float | None = None  # its price, when the model has one

    @property
    def tokens(self) -> int:
        return self.prompt + self.output

    @property
    def cost(self) -> int:
        """The tokens reserved (the name before the prompt/output split)."""
        return self.prompt + self.output

    @property
    def capped(self) -> bool:
        return self.output < self.asked

    @property
    def done(self) -> bool:
        return self.state != "held"

    @property
    def counted(self) -> bool:
        """False when no budget applies to the request (nothing was reserved, nothing to settle)."""
        return self._budgets is not None

    async def finish(
        self, *, sent: bool | None = None, usage: Usage | None = None, backend_error: bool = False,
        reached_backend: bool | None = None,
    ) -> None:
        """Settle by the one rule (`tokens.charge_for`): reported usage exactly; else nothing when the body
        never reached a backend, the prompt estimate when the backend answered with an error, the whole
        reservation otherwise. `reached_backend` is the older name of `sent`."""
        await self._wait(self.finish_nowait(sent=sent, usage=usage, backend_error=backend_error,
                                            reached_backend=reached_backend))

    def finish_nowait(
        self, *, sent: bool | None = None, usage: Usage | None = None, backend_error: bool = False,
        reached_backend: bool | None = None,
    ) -> asyncio.Future[None] | None:
        """`finish` without waiting: the local windows change now, a shared (Redis) settlement is queued
        for the window's next flush (the returned future is done once Redis took it or it failed;
        `close` flushes). For callers off the request path and for refunds in an error path."""
        went = sent if sent is not None else bool(reached_backend)
        charged = charge_for(self.prompt, self.output, usage, sent=went, backend_error=backend_error)
        state: ReservationState = "settled" if usage is not None else "charged" if went else "refunded"
        return self._close_nowait(state, charged)

    async def settle(self, total: int | Usage) -> None:
        used = total if isinstance(total, Usage) else Usage(max(total, 0), 0)
        await self._wait(self._close_nowait("settled", used))

    async def refund(self) -> None:
        await self._wait(self._close_nowait("refunded", Usage(0, 0)))

    def refund_nowait(self) -> None:
        self._close_nowait("refunded", Usage(0, 0))

    async def charge_reserved(self) -> None:
        await self._wait(self._close_nowait("charged", Usage(self.prompt, self.output)))

    def amounts(self, usage: Usage) -> int | list[int]:
        """What each budget counts for `usage`: its tokens (one int when all count tokens), or its price
        in millionths."""
        tokens = max(usage.total, 0)
        if True not in self._units:
            return tokens
        cost = to_micros(self.price.of(usage)) if self.price is not None else 0
        return [cost if is_cost else tokens for is_cost in self._units]

    def _close_nowait(self, state: ReservationState, usage: Usage) -> asyncio.Future[None] | None:
        if self.state != "held":
            return None
        # Decided before any await, so concurrent callers cannot both settle.
        self.state = state
        self.charged_usage = usage
        self.charged = max(usage.total, 0)
        self.charged_cost = self.price.of(usage) if self.price is not None else None
        if self._budgets is None:
            return None
        return self._budgets._settle(self, usage)

    @staticmethod
    async def _wait(done: asyncio.Future[None] | None) -> None:
        if done is not None:
            # Shielded: a caller cancelled mid-call (its stream ended) does not cut the settlement.
            await asyncio.shield(done)
