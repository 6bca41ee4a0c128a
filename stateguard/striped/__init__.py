"""Striped counters: one hot item's amount split over K rows, so K buyers take stock at once.

A guarded counter (:mod:`stateguard.counters`) is one row, whose lock
serialises every buyer of a hot item.  A :class:`StripedCounter` keeps an
item's amount in K rows ("stripes") of ``stateguard_counter_stripes``; a
decrement takes from one stripe nobody else holds, so there are 0 oversold
and 0 lost units, and no deadlock, whatever the concurrency.  How it works on
each database is told in the documentation's explanation of striped counters.

* :mod:`~stateguard.striped.counter`: :class:`StripedCounter`, the public calls;
* :mod:`~stateguard.striped.take`: decrements and increments, written once;
* :mod:`~stateguard.striped.restripe`: changing an item's number of stripes;
* :mod:`~stateguard.striped.ledger`: refs in the counter ledger, and release;
* :mod:`~stateguard.striped.pick`: one module per dialect family behind one interface;
* :mod:`~stateguard.striped.statements`, :mod:`~stateguard.striped.limits`: what they share.

Private members of these modules are used only inside this package.
"""

from __future__ import annotations

from .counter import StripedCounter
from .limits import MAX_AMOUNT, MAX_ITEM, MAX_NAME, MAX_STRIPES, SPACE, stripe_ids

# The InnoDB stripe-count hints, under the name tests clear and seed them by.
from .pick.innodb import stripe_counts as _counts  # noqa: F401

__all__ = ["MAX_AMOUNT", "MAX_ITEM", "MAX_NAME", "MAX_STRIPES", "SPACE", "StripedCounter", "stripe_ids"]
