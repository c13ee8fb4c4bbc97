/*
 * spec/transfer.pml: the KV page ownership / prefill->decode transfer protocol of
 * spec/model.py, stated independently for spin.  spec/model.py is the reference; every
 * action below is one branch of model.py's successors(), with the same name, the same
 * guard and the same effect, and each invariant is an assert at the action where
 * model.py emits the Verdict.
 *
 * Why one process with one d_step per action: model.py's semantics is "any enabled
 * action of any request, one at a time, atomically".  A single process choosing among
 * guarded d_steps in a do loop is exactly that, and it keeps spin's state vector equal to
 * model.py's State (pages + per-request state; the process's pc is always the loop head),
 * so spin's "states stored" of a full search is comparable with spec/check.py's count.
 *
 * Selection (spin passes -D through to the C preprocessor):
 *   configuration  -DCONFIG_TWO | -DCONFIG_THREE (default: three)
 *   variant        -DFIXED (all four fixes) | nothing (BUGGY); single fixes can be
 *                  switched on alone with -DREJECT_FAILS -DDEFERRED_RELEASE
 *                  -DRELEASE_ONCE -DCHECK_SIZE
 *   property       -DPROP_UNWRITTEN_READ -DPROP_FOREIGN_READ -DPROP_USE_AFTER_FREE
 *                  -DPROP_LATE_WRITE -DPROP_DOUBLE_FREE -DPROP_TRANSFER_SIZE_MISMATCH
 *                  -DPROP_ORPHAN_TRANSFER (a warning in model.py, kept separate so FIXED
 *                  can be checked without it); -DPROP_ALL_SAFETY selects all but orphan.
 *                  One property per run keeps the counterexample trail about it.
 *
 * Each action prints "ACT <action>(<request>)" first, so `spin -t` replay of a trail
 * lists the counterexample's actions in model.py's spelling.
 */

/* ------------------------------------------------------------------ configuration */

#define PAGE_TOKENS 4

#if defined(CONFIG_TWO) && defined(CONFIG_THREE)
#error "select one configuration"
#endif

#if defined(CONFIG_TWO)
/* Config(3, (Req("a","acme",1), Req("c","initech",2, too_long=True))) */
#define NP 3
#define NR 2
#define K0 1
#define TL0 0
#define NAME0 'a'
#define K1 2
#define TL1 1
#define NAME1 'c'
#else
/* CONFIG_THREE (the default):
 * Config(4, (Req("a","acme",2), Req("b","globex",1), Req("c","initech",2, too_long=True))) */
#define NP 4
#define NR 3
#define K0 2
#define TL0 0
#define NAME0 'a'
#define K1 1
#define TL1 0
#define NAME1 'b'
#define K2 2
#define TL2 1
#define NAME2 'c'
#endif

#define MAXK 2  /* the largest reservation of any configuration above */

/* how many pages are on the free list (a d_admit guard must be one expression) */
#define PFREE(p) (owner[p] == FREE)
#if NP == 3
#define NFREE (PFREE(1) + PFREE(2) + PFREE(3))
#elif NP == 4
#define NFREE (PFREE(1) + PFREE(2) + PFREE(3) + PFREE(4))
#else
#error "NFREE: add the pool size"
#endif

/* ------------------------------------------------------------------ protocol variant */

#ifdef FIXED
#define REJECT_FAILS 1
#define DEFERRED_RELEASE 1
#define RELEASE_ONCE 1
#define CHECK_SIZE 1
#endif
#ifndef REJECT_FAILS
#define REJECT_FAILS 0      /* 0.5.19 sends a 1-token placeholder as success */
#endif
#ifndef DEFERRED_RELEASE
#define DEFERRED_RELEASE 0  /* a waiting timeout frees the reservation at once */
#endif
#ifndef RELEASE_ONCE
#define RELEASE_ONCE 0      /* the failure path may release a reservation a second time */
#endif
#ifndef CHECK_SIZE
#define CHECK_SIZE 0        /* the sender sends whatever token count it has */
#endif

/* ------------------------------------------------------------------ properties */

#ifdef PROP_ALL_SAFETY
#define PROP_UNWRITTEN_READ
#define PROP_FOREIGN_READ
#define PROP_USE_AFTER_FREE
#define PROP_LATE_WRITE
#define PROP_DOUBLE_FREE
#define PROP_TRANSFER_SIZE_MISMATCH
#endif

/* CHECK_x(c): c is the condition under which model.py emits Verdict x */
#ifdef PROP_UNWRITTEN_READ
#define CHECK_UNWRITTEN_READ(c) assert(!(c))
#else
#define CHECK_UNWRITTEN_READ(c) skip
#endif
#ifdef PROP_FOREIGN_READ
#define CHECK_FOREIGN_READ(c) assert(!(c))
#else
#define CHECK_FOREIGN_READ(c) skip
#endif
#ifdef PROP_USE_AFTER_FREE
#define CHECK_USE_AFTER_FREE(c) assert(!(c))
#else
#define CHECK_USE_AFTER_FREE(c) skip
#endif
#ifdef PROP_LATE_WRITE
#define CHECK_LATE_WRITE(c) assert(!(c))
#else
#define CHECK_LATE_WRITE(c) skip
#endif
#ifdef PROP_DOUBLE_FREE
#define CHECK_DOUBLE_FREE(c) assert(!(c))
#else
#define CHECK_DOUBLE_FREE(c) skip
#endif
#ifdef PROP_TRANSFER_SIZE_MISMATCH
#define CHECK_TRANSFER_SIZE_MISMATCH(c) assert(!(c))
#else
#define CHECK_TRANSFER_SIZE_MISMATCH(c) skip
#endif
#ifdef PROP_ORPHAN_TRANSFER
#define CHECK_ORPHAN_TRANSFER(c) assert(!(c))
#else
#define CHECK_ORPHAN_TRANSFER(c) skip
#endif

/* ------------------------------------------------------------------ state */

#define FREE 15   /* page owner: on the free list (model.py FREE) */
#define PRIOR 14  /* page content: request z, which filled the pool before the trace */
/* model.py's NOBODY (never-written content) cannot arise: every page starts with z's KV */

/* decode side of a request (model.py D_*) */
mtype:d = { D_NEW, D_HELD, D_READY, D_READ, D_DONE, D_TIMEDOUT, D_RELEASED };
/* prefill side (model.py S_*) */
mtype:s = { S_NEW, S_BEGUN, S_SENT, S_FAILED, S_ABORTED, S_GONE };

/* decode pages 1..NP; index 0 is unused so page ids read as in model.py */
byte owner[NP + 1] = FREE;   /* request index or FREE */
byte gen[NP + 1] = 1;        /* bumped at every allocation */
byte content[NP + 1] = PRIOR;/* whose KV the page holds; kept when freed (not zeroed) */

typedef ReqState {
    mtype:d d = D_NEW;
    mtype:s s = S_NEW;
    byte nrow;               /* 0 until d_admit, then the reservation's size */
    byte rowp[MAXK];         /* page ids decode reserved, in row order */
    byte rowg[MAXK];         /* the generation each was assigned with */
    byte sent_tokens;        /* tokens the sender's last chunk covered (0: nothing) */
    byte releases            /* times decode's failure path freed the reservation */
};
ReqState req[NR];

/* Scratch for the loops inside one action.  Not `hidden` (pan's BFS, which the check
 * script uses for shortest counterexamples, refuses hidden variables): instead every
 * action that uses them zeroes them before its d_step ends, so between transitions they
 * are always 0 and the state space is exactly model.py's. */
byte j, pg, nk, bad1, bad2, bad3;
inline scratch_reset() { j = 0; pg = 0; nk = 0; bad1 = 0; bad2 = 0; bad3 = 0 }

/* ------------------------------------------------------------------ helpers */

/* model.py _free: free request i's reserved pages; one already free is a double free */
inline free_row(i) {
    bad1 = 0;
    j = 0;
    do
    :: j < req[i].nrow ->
        pg = req[i].rowp[j];
        if
        :: owner[pg] == FREE -> bad1 = 1
        :: else -> skip
        fi;
        owner[pg] = FREE;
        j++
    :: else -> break
    od;
    CHECK_DOUBLE_FREE(bad1);
    scratch_reset()
}

/* ------------------------------------------------------------------ actions
 *
 * One inline per action of model.py's successors(), for request index i reserving K
 * pages, too_long TL, printed as N.  Each is used as the whole body of a d_step, so its
 * first expression is the action's guard (model.py's `if`) and the rest its effect, one
 * indivisible transition.  Variant switches are constants in guards and conditions, so
 * an action a variant lacks is simply never enabled.
 */

/* ---- decode */

/* d_admit: reserve the K lowest-numbered free pages, bumping each page's generation */
inline d_admit(i, K, N) {
    req[i].d == D_NEW && NFREE >= K ->
    printf("ACT d_admit(%c)\n", N);
    /* reserving for a sender that already ended rejected: held for nothing */
    CHECK_ORPHAN_TRANSFER(req[i].s == S_FAILED);
    nk = 0; pg = 1;
    do
    :: nk < K && owner[pg] == FREE ->
        owner[pg] = i;
        gen[pg] = gen[pg] + 1;
        req[i].rowp[nk] = pg;
        req[i].rowg[nk] = gen[pg];
        nk++; pg++
    :: nk < K && owner[pg] != FREE -> pg++
    :: else -> break
    od;
    req[i].nrow = K;
    req[i].d = D_HELD;
    scratch_reset()
}

/* d_done: decode takes the transfer as successful; it must have carried the K pages'
 * worth of tokens decode reserved */
inline d_done(i, K, N) {
    req[i].d == D_HELD && req[i].s == S_SENT ->
    printf("ACT d_done(%c)\n", N);
    CHECK_TRANSFER_SIZE_MISMATCH(req[i].sent_tokens != K * PAGE_TOKENS);
    req[i].d = D_READY
}

/* d_fail: the sender failed; decode's failure path releases the reservation */
inline d_fail(i, N) {
    req[i].d == D_HELD && req[i].s == S_FAILED ->
    printf("ACT d_fail(%c)\n", N);
    free_row(i);
    req[i].d = D_RELEASED;
    req[i].releases = 1
}

/* d_timeout: decode stops waiting for a sender that has neither finished nor failed.
 * Without deferred_release it frees the reservation now, under the sender's feet. */
inline d_timeout(i, N) {
    req[i].d == D_HELD &&
    (req[i].s == S_NEW || req[i].s == S_BEGUN || req[i].s == S_SENT) ->
    printf("ACT d_timeout(%c)\n", N);
    if
    :: DEFERRED_RELEASE -> req[i].d = D_TIMEDOUT
    :: else ->
        free_row(i);
        req[i].d = D_RELEASED;
        req[i].releases = 1
    fi
}

/* d_release: (deferred_release) after the timeout, free once the sender is done with the room */
inline d_release(i, N) {
    req[i].d == D_TIMEDOUT &&
    (req[i].s == S_SENT || req[i].s == S_FAILED || req[i].s == S_ABORTED || req[i].s == S_GONE) ->
    printf("ACT d_release(%c)\n", N);
    free_row(i);
    req[i].d = D_RELEASED;
    req[i].releases = 1
}

/* d_free_again: (no release_once) the sender's abort reaches decode's poll after the
 * timeout already released the reservation, and the poll's failure path releases it again */
inline d_free_again(i, N) {
    !RELEASE_ONCE && req[i].d == D_RELEASED && req[i].releases == 1 && req[i].s == S_ABORTED ->
    printf("ACT d_free_again(%c)\n", N);
    free_row(i);
    req[i].releases = 2
}

/* d_read: decode attention reads every page of the row.  Per page the first rule that
 * applies (model.py _read): free -> use_after_free; generation moved on -> foreign_read;
 * KV not written for i (stale, or replaced by another's late write) -> unwritten_read.
 * model.py emits one verdict per kind found, whoever it exposes. */
inline d_read(i, N) {
    req[i].d == D_READY ->
    printf("ACT d_read(%c)\n", N);
    bad1 = 0; bad2 = 0; bad3 = 0;
    j = 0;
    do
    :: j < req[i].nrow ->
        pg = req[i].rowp[j];
        if
        :: owner[pg] == FREE -> bad1 = 1
        :: else ->
            if
            :: gen[pg] != req[i].rowg[j] -> bad2 = 1
            :: else ->
                if
                :: content[pg] != i -> bad3 = 1
                :: else -> skip
                fi
            fi
        fi;
        j++
    :: else -> break
    od;
    CHECK_USE_AFTER_FREE(bad1);
    CHECK_FOREIGN_READ(bad2);
    CHECK_UNWRITTEN_READ(bad3);
    req[i].d = D_READ;
    scratch_reset()
}

/* d_end: the request finished; its pages go back to the free list */
inline d_end(i, N) {
    req[i].d == D_READ ->
    printf("ACT d_end(%c)\n", N);
    free_row(i);
    req[i].d = D_DONE
}

/* ---- prefill */

/* p_gone: decode gave up before prefill began: the bootstrap fails, nothing is ever sent */
inline p_gone(i, N) {
    req[i].s == S_NEW && (req[i].d == D_TIMEDOUT || req[i].d == D_RELEASED) ->
    printf("ACT p_gone(%c)\n", N);
    req[i].s = S_GONE
}

/* p_begin: prefill starts, whatever decode has done meanwhile (it cannot know yet) */
inline p_begin(i, N) {
    req[i].s == S_NEW ->
    printf("ACT p_begin(%c)\n", N);
    req[i].s = S_BEGUN
}

/* the sender refuses the over-long prompt (reject_fails, or the guard's send_size check) */
#define REFUSE(TL) ((TL) && (REJECT_FAILS || CHECK_SIZE))

/* p_send: the transfer lands in the page ids decode reserved, whoever owns them now.
 * 0.5.19 sends an over-long request's 1-token placeholder as a success; the chunk covers
 * the first ceil(sent / PAGE_TOKENS) pages of the row (model.py _write). */
inline p_send(i, K, TL, N) {
    req[i].s == S_BEGUN && req[i].d != D_NEW && req[i].nrow > 0 && !REFUSE(TL) ->
    printf("ACT p_send(%c)\n", N);
    req[i].sent_tokens = (TL -> 1 : K * PAGE_TOKENS);
    nk = (req[i].sent_tokens + PAGE_TOKENS - 1) / PAGE_TOKENS;
    bad1 = 0; bad2 = 0;
    j = 0;
    do
    :: j < nk ->
        pg = req[i].rowp[j];
        if
        :: owner[pg] == FREE -> bad1 = 1                      /* into a free page */
        :: owner[pg] != FREE && owner[pg] != i -> bad2 = 1     /* into another's page */
        :: else -> skip
        fi;
        content[pg] = i;
        j++
    :: else -> break
    od;
    CHECK_LATE_WRITE(bad2);
    CHECK_USE_AFTER_FREE(bad1);
    req[i].s = S_SENT;
    scratch_reset()
}

/* p_fail: the sender refuses the over-long prompt and fails the transfer.  Decode still
 * holding the reservation then waits on a sender that ended: orphan_transfer (a warning;
 * decode's d_fail or d_timeout ends it). */
inline p_fail(i, TL, N) {
    req[i].s == S_BEGUN && REFUSE(TL) ->
    printf("ACT p_fail(%c)\n", N);
    CHECK_ORPHAN_TRANSFER(req[i].d == D_HELD);
    req[i].s = S_FAILED
}

/* p_abort: the sender learns decode gave up and aborts */
inline p_abort(i, N) {
    req[i].s == S_BEGUN && (req[i].d == D_TIMEDOUT || req[i].d == D_RELEASED) ->
    printf("ACT p_abort(%c)\n", N);
    req[i].s = S_ABORTED
}

/* ------------------------------------------------------------------ the system */

/* every action of request i, each one indivisible transition (model.py's interleaving) */
#define ACTIONS(i, K, TL, N) \
    :: d_step { d_admit(i, K, N) } \
    :: d_step { d_done(i, K, N) } \
    :: d_step { d_fail(i, N) } \
    :: d_step { d_timeout(i, N) } \
    :: d_step { d_release(i, N) } \
    :: d_step { d_free_again(i, N) } \
    :: d_step { d_read(i, N) } \
    :: d_step { d_end(i, N) } \
    :: d_step { p_gone(i, N) } \
    :: d_step { p_begin(i, N) } \
    :: d_step { p_send(i, K, TL, N) } \
    :: d_step { p_fail(i, TL, N) } \
    :: d_step { p_abort(i, N) }

active proctype engines() {
    /* a state with no action enabled (every request over) is a valid end state */
end:
    do
    ACTIONS(0, K0, TL0, NAME0)
    ACTIONS(1, K1, TL1, NAME1)
#if NR > 2
    ACTIONS(2, K2, TL2, NAME2)
#endif
    od
}
