"""What a routed request is charged, and the usage record that says so.

Plain functions of the director's: the output limit a budgeted request carries to the backend
(`bound_output`) and, at its end, its termination cause from Envoy's report
(`gateway/settlement.UsageReport`). The charge itself is the reservation's (`Reservation.finish_nowait`,
the one settlement rule `budgets.tokens.charge_for`), which the usage record repeats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from modeldock.flowcontrol.cost import OutputLimit, write_output_limit
from modeldock.gateway.settlement import UsageReport
from modeldock.usage.record import Termination

LimitReason = Literal["", "default", "budget"]


@dataclass(frozen=True, slots=True)
class Bound:
    """The output limit a request goes upstream with, when the gateway wrote or lowered it."""

    per_choice: int | None  # what the backend reads now (None: unbounded, no budget or records apply)
    reason: LimitReason  # "" unchanged, "default": the client set none, "budget": lowered to what the budget had


def bound_output(data: dict[str, object], limit: OutputLimit, reserved_output: int, *, capped: bool,
                 chat: bool) -> Bound:
    """Make the body's output limit at most what was reserved (`reserved_output`, all choices): written in
    when the client gave none, lowered when the budget capped the reservation below what it asked."""
    if limit.per_choice is not None and not capped:
        return Bound(limit.per_choice, "")
    per_choice = reserved_output // limit.choices
    write_output_limit(data, per_choice, chat=chat)
    return Bound(per_choice, "budget" if capped else "default")


def termination(report: UsageReport | None) -> Termination:
    """Why the request ended, from Envoy's report (no report: completed as far as the gateway knows)."""
    if report is None:
        return "completed"
    if report.cancelled:
        return "client_disconnect"
    if report.timed_out:
        return "timeout"
    if report.upstream_failed or report.backend_error or report.status >= 500 or report.status == 0:
        return "upstream_error"
    return "completed"
