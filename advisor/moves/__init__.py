"""Carrying a plan out: the planner's budget, the move guard and the mover.

Modules: ``planner`` (token bucket and concurrency limit over plan items), ``move_guard``
(no block moves again too soon), ``mover`` (a verified copy, the catalog switch, the Store and
Remove events).
"""

from advisor.moves.planner import Plan, Planner, TokenBucket
from advisor.moves.move_guard import MoveGuard
from advisor.moves.mover import Mover, MoverCounters

__all__ = [
    "MoveGuard",
    "Mover",
    "MoverCounters",
    "Plan",
    "Planner",
    "TokenBucket",
]
