"""``privkit ledger verify`` and ``privkit ledger recover``: open a ledger journal, or
continue one that lost committed entries.

Its parser and what it prints. Apart from :mod:`privkit.cli` because it is the only command
that opens a ledger (imported when it runs, so the parser stays light).
"""

from __future__ import annotations

import argparse
from typing import Any

from privkit._cli_base import add_json, emit, subcommands
from privkit.errors import InvalidParameterError

__all__ = ["add_ledger_parser", "run_ledger"]


def add_ledger_parser(sub: Any) -> None:
    """``privkit ledger verify`` and ``privkit ledger recover``."""
    le_sub = subcommands(sub, "ledger", "verify a ledger journal, or recover one that lost "
                         "committed entries", dest="action")
    v = le_sub.add_parser(
        "verify", help="open (verify chains and head record) and summarise",
        description="Open a ledger journal: every hash chain, sequence number and event is "
        "verified, and the journal must hold every entry its head record (PATH.head) says was "
        "committed. Exit status 0 if it opens, 2 if not. Set PRIVKIT_LEDGER_KEY or "
        "PRIVKIT_LEDGER_KEY_FILE for a ledger whose head record is authenticated.")
    v.add_argument("path", metavar="PATH", help="the journal (e.g. OUT/ledger-upcycled.jsonl)")
    add_json(v)
    r = le_sub.add_parser(
        "recover", help="continue a journal that disagrees with its head record, as it is",
        description="For a journal that is behind its head record (entries lost by a restore "
        "from backup, a cut, a deleted batch) or disagrees with it otherwise: continue from "
        "the journal as it is. The lost spend is not restored; a recover entry (the problem, "
        "the head record found, the reason, the time) is appended and the head record moved "
        "to it. Refused when there is nothing to recover.")
    r.add_argument("path", metavar="PATH", help="the journal")
    r.add_argument("--accept-rollback", action="store_true",
                   help="required: accept that the spend the journal lost is forgotten")
    r.add_argument("--reason", default="accepted with privkit ledger recover --accept-rollback",
                   help="why (recorded in the recover entry)")
    add_json(r)


def run_ledger(a: argparse.Namespace) -> None:
    from privkit.ledger import Ledger

    if a.action == "recover":
        if not a.accept_rollback:
            raise InvalidParameterError(
                "accept_rollback", False, "given: recovery continues from the journal as it "
                "is and forgets the spend its head record says was committed")
        led = Ledger.recover(a.path, reason=a.reason)
    else:
        led = Ledger.open(a.path)
    rep = led.report()
    head = led.head()
    out = {"path": led.path, "population_id": led.population_id, "head_seq": head.seq,
           "head_hash": head.hash, "clients": len(rep.client_ids), "epsilon_max": rep.max,
           "epsilon_mean": rep.mean, "delta": led.delta, "method": led.method.value,
           "epsilon_budget": led.epsilon_budget, "discarded_bytes": led.discarded_bytes,
           "head_note": led.head_note}
    verb = "recovered" if a.action == "recover" else "verified"
    text = (f"{led.path}: {verb}: head seq {head.seq} ({head.hash[:12]}...), "
            f"{len(rep.client_ids)} clients, epsilon max {rep.max:.6g} mean {rep.mean:.6g} at "
            f"delta={led.delta:g} [{led.method.value}]"
            + (f"\n  {led.head_note}" if led.head_note else ""))
    emit(out, a.json, text)
