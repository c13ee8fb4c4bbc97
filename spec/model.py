"""The executable specification: KV page ownership on a decode engine and the
prefill/decode transfer protocol, as an explicit-state transition system.

A *state* is the ground truth the engines hold (never what kvguard believes): for every
decode page its owner, its allocation generation and whose KV it holds; for every request
where each end of its transfer is. An *action* is one thing an engine does; it yields
the records the engine's probes would emit (``Event``) and, where it breaks an invariant,
a ``Verdict``: the finding kvguard must raise (kind, reader, exposed parties). kvguard is
not consulted anywhere in this file: spec/check.py explores it, spec/conformance.py
compares kvguard's replay of each trace with the verdicts here.

The invariants (docs/spec.md maps each to its finding kind):

* a forward reads only pages of its own row, still at the generation they were assigned
  with, not free, holding KV written for the reader at that generation
  (``use_after_free`` / ``foreign_read`` / ``unwritten_read``; a page of the reader's row
  whose KV another request's late write replaced holds KV not written for the reader:
  ``unwritten_read``, naming the late writer);
* a KV write (a transfer landing) goes only into pages its request still owns
  (``late_write`` into another request's page, ``use_after_free`` into a free one);
* a page is freed only while allocated (``double_free``);
* a transfer decode takes as successful carried as many tokens as decode reserved
  (``transfer_size_mismatch``);
* decode does not hold a reservation for a sender that ended without sending
  (``orphan_transfer``, a warning: raised when both hold, whichever came second).

Protocol variants (``Protocol``): each fix of the incident's family is a switch, so the
checker can show each bug on the protocol without its fix and the fixed protocol free of
all of them.

Sends in flight (``Config.prefill_pages`` > 0, an option: it multiplies the interleavings,
so only the configurations that ask for it have it). A send is then two steps, as it is on
the engines: ``p_send`` (XFER_SEND: the chunk is posted, its bytes are not yet anywhere) and
``p_complete`` (the sender reads its source pages *as they are then*, the bytes land in the
reserved decode page ids *whoever owns them then*, XFER_DONE sender success, REQ_END). The
sender's pages are modelled too (a prefill pool: the prompt is computed into them at
``p_begin``), so two more invariants are checked at the completion:

* the sender reads only its own source pages, at the generation they had when sent
  (``use_after_free``, access ``send``: the chunk carries whoever was given them since);
* a landing write overwrites no other request's KV: a reserved page allocated to another
  request before the completion is that request's integrity broken (``late_write``, access
  ``completion``).

Decode reading the KV such a completion brought is the read invariant again, with the
verdict's ``cause`` saying where the KV came from (spec/conformance.py maps it to the
finding kvguard raises for it).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

PAGE_TOKENS = 4  # tokens per page (the records speak slots; the model speaks pages)
FREE = -1  # the owner of a page in the free list
NOBODY = -1  # whose KV a never-written page holds
PRIOR = -2  # the request that filled the pool before the trace (its KV is what a stale page exposes)
PRIOR_NAME = "z"
PRIOR_TENANT = "prior"


@dataclass(frozen=True)
class Req:
    """One client request, served by prefill and decode (one bootstrap room)."""

    name: str
    tenant: str
    pages: int  # pages decode reserves: the prompt fills them, pages * PAGE_TOKENS tokens
    too_long: bool = False  # prefill rejects the prompt (the incident's over-long request)
    patient: bool = False  # decode never times out waiting for it (fewer traces: its sender is on time)

    @property
    def tokens(self) -> int:
        return self.pages * PAGE_TOKENS


@dataclass(frozen=True)
class Protocol:
    """Which fixes the engines have. ``BUGGY``: none (SGLang 0.5.19 and the race family);
    ``FIXED``: all of them."""

    name: str
    reject_fails: bool  # a rejected request fails at both ends; 0.5.19 sends a 1-token placeholder as success
    deferred_release: bool  # after a waiting timeout decode frees only once the sender finished with the room
    release_once: bool  # a reservation is released once; the buggy failure path releases it a second time
    check_size: bool  # the sender refuses to send a token count other than decode reserved (the guard's send_size)
    # prefill keeps a sent chunk's source pages until its transfer completes (only with sends
    # in flight); without it prefill may release them early, while the bytes are still to move
    hold_until_sent: bool = False


BUGGY = Protocol("buggy", False, False, False, False, False)
FIXED = Protocol("fixed", True, True, True, True, True)


# decode side of a request
D_NEW, D_HELD, D_READY, D_READ, D_DONE, D_TIMEDOUT, D_RELEASED = (
    "new",
    "held",
    "ready",
    "read",
    "done",
    "timedout",
    "released",
)
# prefill side
S_NEW, S_BEGUN, S_SENT, S_FAILED, S_ABORTED, S_GONE = "new", "begun", "sent", "failed", "aborted", "gone"
S_SENDING = "sending"  # sent, not completed: the chunk's bytes are still to move (sends in flight only)
S_TERMINAL = (S_SENT, S_FAILED, S_ABORTED, S_GONE)


class Page(NamedTuple):
    owner: int  # request index, FREE
    gen: int  # bumped at every allocation
    content: int  # whose KV it holds: request index, PRIOR, NOBODY; kept when freed (pages are not zeroed)
    # the request whose transfer completion landed the content (sends in flight only; NOBODY
    # otherwise): decode reading it is judged with the cause of the KV it holds
    via: int = NOBODY


class ReqState(NamedTuple):
    d: str
    s: str
    row: tuple  # ((page, gen), ...) decode reserved, in row order
    sent_tokens: int  # tokens the sender's last chunk covered (0: nothing sent)
    releases: int  # how many times decode's failure path freed the reservation
    src: tuple = ()  # ((page, gen), ...) the sender's own pages on prefill (sends in flight only)
    src_freed: bool = False  # prefill released them (early, while in flight, on the buggy protocol)


class State(NamedTuple):
    pages: tuple  # Page per decode page id 1..P (index 0 = page 1)
    reqs: tuple  # ReqState per request
    ppages: tuple = ()  # Page per prefill page id 1..Q (sends in flight only)


class Event(NamedTuple):
    """What the engines' probes emit for one action (spec/conformance.py turns it into records)."""

    op: str
    req: int
    pages: tuple = ()  # decode page ids
    tokens: int = 0
    src: tuple = ()  # prefill page ids (sends in flight only: the sender's pages, as the probes name them)


# why a read verdict's KV is in the page (sends in flight only; "" otherwise)
CAUSE_SEND = "send"  # the reader's own transfer carried it, from a source page reused in flight
CAUSE_COMPLETION = "completion"  # another request's late completion landed it


class Verdict(NamedTuple):
    kind: str
    reader: str | None  # request name (both ends of a request share it); None: no reader (double_free)
    exposed: frozenset  # request names whose KV (or pages) the event exposed
    access: str = ""  # "send" / "completion": the invariants of a send in flight (kvguard's evidence.access)
    cause: str = ""  # a read verdict's: CAUSE_SEND / CAUSE_COMPLETION, or "" (what put the KV there)


class Step(NamedTuple):
    action: str  # "d_admit(a)"
    state: State
    events: tuple
    verdicts: tuple


@dataclass(frozen=True)
class Config:
    pages: int  # decode pool, page ids 1..pages
    reqs: tuple  # Req
    # the prefill pool (page ids 1..prefill_pages); > 0 turns on sends in flight (p_send, then
    # p_complete) and the sender's pages; 0: the send is one atomic step, prefill not modelled
    prefill_pages: int = 0

    @property
    def in_flight(self) -> bool:
        return self.prefill_pages > 0


def initial(cfg: Config) -> State:
    """The pool after request ``z`` (tenant ``prior``) filled every page and ended: every page
    free and holding z's KV, which is what a stale read exposes. Prefill's pages (sends in
    flight) start free and never written: z's were others (spec/conformance.py)."""
    pages = tuple(Page(FREE, 1, PRIOR) for _ in range(cfg.pages))
    reqs = tuple(ReqState(D_NEW, S_NEW, (), 0, 0) for _ in cfg.reqs)
    ppages = tuple(Page(FREE, 0, NOBODY) for _ in range(cfg.prefill_pages))
    return State(pages, reqs, ppages)


def name_of(cfg: Config, who: int) -> str | None:
    if who == PRIOR:
        return PRIOR_NAME
    if who == NOBODY:
        return None
    return cfg.reqs[who].name


def _set(t: tuple, i: int, v) -> tuple:
    return t[:i] + (v,) + t[i + 1 :]


def _free_pages(state: State) -> list[int]:
    return [i + 1 for i, p in enumerate(state.pages) if p.owner == FREE]


def _free(cfg: Config, pages: tuple, page_ids, verdicts: list, reader: str | None) -> tuple:
    """Free ``page_ids``; a page already free is a double free (its last writer exposed:
    the free list may hand it to two requests)."""
    double, exposed = [], set()
    for pid in page_ids:
        p = pages[pid - 1]
        if p.owner == FREE:
            double.append(pid)
            who = name_of(cfg, p.content)
            if who is not None:
                exposed.add(who)
        pages = _set(pages, pid - 1, p._replace(owner=FREE))
    if double:
        verdicts.append(Verdict("double_free", None, frozenset(exposed)))
    return pages


def _read(cfg: Config, state: State, i: int, verdicts: list) -> None:
    """Request ``i`` reads every page of its row (decode attention over the prompt)."""
    me = cfg.reqs[i].name
    found: dict[tuple[str, str], set] = {}
    for pid, gen in state.reqs[i].row:
        p = state.pages[pid - 1]
        cause = ""
        if p.owner == FREE:
            kind, exposed = "use_after_free", {name_of(cfg, p.content)}
        elif p.gen != gen:
            kind, exposed = "foreign_read", {name_of(cfg, p.owner), name_of(cfg, p.content)}
        elif p.content != i:
            # stale KV, or a late write of another request replaced i's own: not written for i;
            # or (sends in flight) i's own transfer carried another's KV from a reused source page
            kind, exposed = "unwritten_read", {name_of(cfg, p.content)}
            if p.via != NOBODY:
                cause = CAUSE_SEND if p.via == i else CAUSE_COMPLETION
        else:
            continue
        found.setdefault((kind, cause), set()).update(e for e in exposed if e is not None and e != me)
    for (kind, cause), exposed in found.items():
        verdicts.append(Verdict(kind, me, frozenset(exposed), cause=cause))


def _write(cfg: Config, state: State, i: int, page_ids, verdicts: list, land: bool = True) -> tuple:
    """Request ``i``'s transfer writes ``page_ids``: a page it no longer owns is a late write.
    ``land=False`` (a send in flight): the write is issued, its bytes land at ``p_complete``."""
    pages = state.pages
    me = cfg.reqs[i].name
    late, freed = set(), False
    for pid in page_ids:
        p = pages[pid - 1]
        if p.owner == FREE:
            freed = True
        elif p.owner != i:
            late.add(name_of(cfg, p.owner))
        if land:
            pages = _set(pages, pid - 1, p._replace(content=i))
    if late:
        verdicts.append(Verdict("late_write", me, frozenset(late)))
    if freed:
        verdicts.append(Verdict("use_after_free", me, frozenset()))
    return pages


# ------------------------------------------------------------------ sends in flight
def _alloc_prefill(ppages: tuple, i: int, n: int) -> tuple[tuple, tuple] | None:
    """The lowest ``n`` free prefill pages for request ``i``, its prompt computed into them
    (content i): (pool, ((page, gen), ...)), or None when the pool has fewer free."""
    free = [k + 1 for k, p in enumerate(ppages) if p.owner == FREE]
    if len(free) < n:
        return None
    src = []
    for pid in free[:n]:
        p = ppages[pid - 1]
        ppages = _set(ppages, pid - 1, Page(i, p.gen + 1, i))
        src.append((pid, p.gen + 1))
    return ppages, tuple(src)


def _free_prefill(ppages: tuple, src: tuple) -> tuple:
    for pid, _ in src:
        ppages = _set(ppages, pid - 1, ppages[pid - 1]._replace(owner=FREE))
    return ppages


def _complete(cfg: Config, state: State, i: int, verdicts: list) -> tuple[tuple, tuple]:
    """Request ``i``'s sender completes: it reads its source pages as they are now, and their
    bytes land in the reserved decode pages as they are now. (decode pool, pages landed in)"""
    r, me = state.reqs[i], cfg.reqs[i].name
    landed = tuple(p for p, _ in r.row[: -(-r.sent_tokens // PAGE_TOKENS)])
    # a source page given to another request since the send (its generation moved): the chunk
    # carries whatever that request computed there (a page only freed still holds i's KV)
    moved = [state.ppages[pid - 1] for pid, gen in r.src if state.ppages[pid - 1].gen != gen]
    if moved:
        exposed = {name_of(cfg, p.content) for p in moved} | {name_of(cfg, p.owner) for p in moved if p.owner != FREE}
        verdicts.append(Verdict("use_after_free", me, frozenset(exposed - {None, me}), access="send"))
    pages, overwritten = state.pages, set()
    for (spid, _), pid in zip(r.src, landed, strict=True):
        p = pages[pid - 1]
        if p.owner not in (FREE, i):  # allocated to another request: its KV is overwritten
            overwritten.add(name_of(cfg, p.owner))
        pages = _set(pages, pid - 1, p._replace(content=state.ppages[spid - 1].content, via=i))
    if overwritten:
        verdicts.append(Verdict("late_write", me, frozenset(overwritten), access="completion"))
    return pages, landed


def successors(cfg: Config, proto: Protocol, state: State) -> Iterator[Step]:
    """Every action enabled in ``state``, with the state it leads to."""
    for i, req in enumerate(cfg.reqs):
        r = state.reqs[i]
        name = req.name

        def step(action, new_r=None, pages=None, events=(), verdicts=(), ppages=None, i=i, name=name):
            reqs = state.reqs if new_r is None else _set(state.reqs, i, new_r)
            return Step(
                f"{action}({name})",
                State(state.pages if pages is None else pages, reqs, state.ppages if ppages is None else ppages),
                tuple(events),
                tuple(verdicts),
            )

        # ---- decode
        if r.d == D_NEW:
            free = _free_pages(state)
            if len(free) >= req.pages:
                taken = free[: req.pages]
                pages = state.pages
                row = []
                for pid in taken:
                    p = pages[pid - 1]
                    pages = _set(pages, pid - 1, p._replace(owner=i, gen=p.gen + 1))
                    row.append((pid, p.gen + 1))
                # reserving for a sender that already ended rejected: held for nothing
                v = [Verdict("orphan_transfer", name, frozenset())] if r.s == S_FAILED else []
                yield step(
                    "d_admit",
                    r._replace(d=D_HELD, row=tuple(row)),
                    pages,
                    [Event("d_admit", i, tuple(taken), req.tokens)],
                    v,
                )
        if r.d == D_HELD and r.s == S_SENT:
            v = []
            if r.sent_tokens != req.tokens:
                v.append(Verdict("transfer_size_mismatch", name, frozenset()))
            yield step("d_done", r._replace(d=D_READY), events=[Event("d_done", i)], verdicts=v)
        if r.d == D_HELD and r.s == S_FAILED:
            v = []
            pages = _free(cfg, state.pages, [p for p, _ in r.row], v, name)
            yield step(
                "d_fail",
                r._replace(d=D_RELEASED, releases=1),
                pages,
                [Event("d_fail", i, tuple(p for p, _ in r.row))],
                v,
            )
        if r.d == D_HELD and r.s in (S_NEW, S_BEGUN, S_SENDING, S_SENT) and not req.patient:
            row_pages = tuple(p for p, _ in r.row)
            if proto.deferred_release:
                yield step("d_timeout", r._replace(d=D_TIMEDOUT), events=[Event("d_timeout", i)])
            else:
                v = []
                pages = _free(cfg, state.pages, row_pages, v, name)
                yield step(
                    "d_timeout", r._replace(d=D_RELEASED, releases=1), pages, [Event("d_timeout", i, row_pages)], v
                )
        if r.d == D_TIMEDOUT and r.s in S_TERMINAL:
            v = []
            row_pages = tuple(p for p, _ in r.row)
            pages = _free(cfg, state.pages, row_pages, v, name)
            yield step("d_release", r._replace(d=D_RELEASED, releases=1), pages, [Event("d_release", i, row_pages)], v)
        if r.d == D_RELEASED and not proto.release_once and r.releases == 1 and r.s == S_ABORTED:
            # the sender's abort reaches decode's poll after the timeout already released the
            # reservation, and the poll's failure path releases it again
            v = []
            row_pages = tuple(p for p, _ in r.row)
            pages = _free(cfg, state.pages, row_pages, v, name)
            yield step("d_free_again", r._replace(releases=2), pages, [Event("d_free_again", i, row_pages)], v)
        if r.d == D_READY:
            v = []
            _read(cfg, state, i, v)
            yield step(
                "d_read",
                r._replace(d=D_READ),
                events=[Event("d_read", i, tuple(p for p, _ in r.row), req.tokens)],
                verdicts=v,
            )
        if r.d == D_READ:
            v = []
            row_pages = tuple(p for p, _ in r.row)
            pages = _free(cfg, state.pages, row_pages, v, name)
            yield step("d_end", r._replace(d=D_DONE), pages, [Event("d_end", i, row_pages)], v)

        # ---- prefill
        if cfg.in_flight:
            yield from _prefill_in_flight(cfg, proto, state, i, step)
            continue
        if r.s == S_NEW:
            if r.d in (D_TIMEDOUT, D_RELEASED):
                # decode gave up before prefill began: the bootstrap fails, nothing is ever sent
                yield step("p_gone", r._replace(s=S_GONE))
            yield step("p_begin", r._replace(s=S_BEGUN), events=[Event("p_begin", i, (), req.tokens)])
        if r.s == S_BEGUN and r.row:  # decode has reserved (its row is empty until d_admit)
            if not _refuses(req, proto):
                # the sender writes into the page ids decode reserved, whoever owns them now
                sent = _sent_tokens(req)
                landed = tuple(p for p, _ in r.row[: -(-sent // PAGE_TOKENS)])
                v = []
                pages = _write(cfg, state, i, landed, v)
                yield step(
                    "p_send", r._replace(s=S_SENT, sent_tokens=sent), pages, [Event("p_send", i, landed, sent)], v
                )
        if r.s == S_BEGUN and _refuses(req, proto):
            yield _p_fail(cfg, r, i, step)
        if r.s == S_BEGUN and r.d in (D_TIMEDOUT, D_RELEASED):
            yield step("p_abort", r._replace(s=S_ABORTED), events=[Event("p_abort", i)])


def _refuses(req: Req, proto: Protocol) -> bool:
    """The sender fails a rejected prompt rather than send it (either fix closes the path)."""
    return req.too_long and (proto.reject_fails or proto.check_size)


def _sent_tokens(req: Req) -> int:
    return 1 if req.too_long else req.tokens  # 0.5.19: a rejected prompt's 1-token placeholder, sent as done


def _p_fail(cfg: Config, r: ReqState, i: int, step) -> Step:
    v = [Verdict("orphan_transfer", cfg.reqs[i].name, frozenset())] if r.d == D_HELD else []
    return step("p_fail", r._replace(s=S_FAILED), events=[Event("p_fail", i)], verdicts=v)


def _prefill_in_flight(cfg: Config, proto: Protocol, state: State, i: int, step) -> Iterator[Step]:
    """The sender's actions when a send is in flight until it completes (``Config.prefill_pages``)."""
    r, req = state.reqs[i], cfg.reqs[i]
    gave_up = r.d in (D_TIMEDOUT, D_RELEASED)
    if r.s == S_NEW:
        if gave_up:
            yield step("p_gone", r._replace(s=S_GONE))
        if req.too_long:  # rejected at admission: nothing computed
            yield step("p_begin", r._replace(s=S_BEGUN), events=[Event("p_begin", i, (), req.tokens)])
        else:
            got = _alloc_prefill(state.ppages, i, req.pages)
            if got is not None:  # (else prefill waits for pages)
                ppages, src = got
                ev = Event("p_begin", i, (), req.tokens, tuple(p for p, _ in src))
                yield step("p_begin", r._replace(s=S_BEGUN, src=src), events=[ev], ppages=ppages)
    # the send is posted while decode waits with its reservation: a sender whose receiver already
    # gave up sends into released pages at once, which the atomic configurations cover; here the
    # window is the one between the send and its completion
    if r.s == S_BEGUN and r.d == D_HELD and not _refuses(req, proto):
        yield from _p_send_in_flight(cfg, state, i, step)
    if r.s == S_BEGUN and _refuses(req, proto):
        yield _p_fail(cfg, r, i, step)
    if r.s == S_SENDING and not r.src_freed and not proto.hold_until_sent:
        # the buggy release: prefill gives the sender's pages back while the bytes are still to move
        ev = Event("p_release", i, src=tuple(p for p, _ in r.src))
        yield step("p_release", r._replace(src_freed=True), events=[ev], ppages=_free_prefill(state.ppages, r.src))
    if r.s == S_SENDING:
        v: list = []
        pages, landed = _complete(cfg, state, i, v)
        held = () if r.src_freed else r.src
        ev = Event("p_complete", i, landed, r.sent_tokens, tuple(p for p, _ in held))
        ppages = _free_prefill(state.ppages, held)
        yield step("p_complete", r._replace(s=S_SENT, src_freed=True), pages, [ev], v, ppages)
    if r.s == S_BEGUN and gave_up:
        # decode's abort reaches the sender before it sent: it stops and gives its pages back.
        # (A transfer already in flight always completes here: whether a failed one's bytes
        # landed is known to nobody, and kvguard does not judge a failed completion.)
        ev = Event("p_abort", i, src=tuple(p for p, _ in r.src))
        ppages = _free_prefill(state.ppages, r.src)
        yield step("p_abort", r._replace(s=S_ABORTED, src_freed=True), events=[ev], ppages=ppages)


def _p_send_in_flight(cfg: Config, state: State, i: int, step) -> Iterator[Step]:
    r, req = state.reqs[i], cfg.reqs[i]
    sent = _sent_tokens(req)
    ppages, src = state.ppages, r.src
    if req.too_long:  # the placeholder is computed for the send
        got = _alloc_prefill(ppages, i, -(-sent // PAGE_TOKENS))
        if got is None:
            return
        ppages, src = got
    landed = tuple(p for p, _ in r.row[: -(-sent // PAGE_TOKENS)])
    v: list = []
    _write(cfg, state, i, landed, v, land=False)  # issued into pages i no longer owns: judged now
    ev = Event("p_send", i, landed, sent, tuple(p for p, _ in src))
    yield step("p_send", r._replace(s=S_SENDING, sent_tokens=sent, src=src), events=[ev], verdicts=v, ppages=ppages)
