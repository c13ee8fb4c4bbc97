/* kvguard sidecar kernels: a decode step's page-model updates in one call each.
 *
 * Why C: a decode step of batch 256 is judged by tens of numpy calls over 256-entry
 * arrays, each ~1-1.5 us of fixed cost in the ingest loop for a few hundred nanoseconds
 * of arithmetic (docs/performance.md, "Bottlenecks and proposals", item 9). A ctypes call
 * pays ~1 us per array handed over; a CPython extension taking buffers pays ~25 ns.
 *
 * Each kernel is the exact rule set of a Python fast path (named in its comment), which
 * stays as the fallback (kvguard.sidecar.native says which runs). A kernel either does
 * all of its work or none of it: every check runs before the first store, and any doubt
 * answers "not mine" so the caller takes the general (Python) path. No kernel allocates
 * Python objects besides its result, keeps a reference or releases the GIL.
 *
 * The arrays are the page pool's columns (kvguard.sidecar.page_pool.PagePool) and a
 * record's decoded arrays, passed as buffers; their item sizes and lengths are checked
 * here (a mismatch raises ValueError: a caller bug, never a data-dependent path).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define KVG_KERNELS_ABI 1

/* kvguard.sidecar.page_pool */
#define ST_UNKNOWN 0
#define ST_FREE 1
#define ST_ALLOCATED 2
#define ST_OWNED 3
#define PADDING_PAGE 0
#define GEN_MASK 0x7FFFFFFFu
#define SHARED_BIT 0x80000000u

/* ------------------------------------------------------------------ buffers */
typedef struct {
    Py_buffer view;
    int held;
} buf_t;

/* 'i': a signed integer, 'u': an unsigned one, of `itemsize` bytes; '?': a bool */
static int kind_matches(const Py_buffer *v, char kind, Py_ssize_t itemsize) {
    if (v->itemsize != itemsize || v->format == NULL)
        return 0;
    const char *f = v->format;
    if (*f == '<' || *f == '=' || *f == '@' || *f == '|')
        f++;
    if (f[0] == 0 || f[1] != 0)
        return 0;
    if (kind == '?')
        return f[0] == '?';
    return strchr(kind == 'i' ? "bhilq" : "BHILQ", f[0]) != NULL;
}

/* Whether the error set says the object offers no contiguous buffer (numpy: ValueError for
 * a strided view; BufferError; TypeError for an object without the protocol) */
static int not_a_buffer(void) {
    return PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_TypeError) ||
           PyErr_ExceptionMatches(PyExc_ValueError);
}

/* 1: taken as `kind`/`itemsize`; 0: another type (released; `strict` raises ValueError
 * instead); -1: an error is set */
static int take(PyObject *obj, buf_t *b, char kind, Py_ssize_t itemsize, int writable, int strict, const char *name) {
    if (PyObject_GetBuffer(obj, &b->view, (writable ? PyBUF_WRITABLE : 0) | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        /* not a contiguous buffer (a strided view, a list): the numpy path, unless strict */
        if (!strict && not_a_buffer()) {
            PyErr_Clear();
            return 0;
        }
        return -1;
    }
    b->held = 1;
    if (kind_matches(&b->view, kind, itemsize))
        return 1;
    if (strict) {
        PyErr_Format(PyExc_ValueError, "%s: items of format '%s' (%zd bytes), not %s%zd", name,
                     b->view.format ? b->view.format : "B", b->view.itemsize,
                     kind == 'i' ? "int" : kind == 'u' ? "uint" : "bool", kind == '?' ? (Py_ssize_t)0 : itemsize * 8);
        return -1;
    }
    PyBuffer_Release(&b->view);
    b->held = 0;
    return 0;
}

static void release(buf_t *bufs, int n) {
    for (int i = 0; i < n; i++)
        if (bufs[i].held) {
            PyBuffer_Release(&bufs[i].view);
            bufs[i].held = 0;
        }
}

/* One array argument: its name (for errors), type ('i', 'u', '?'), item size, writable */
typedef struct {
    const char *name;
    char kind;
    Py_ssize_t itemsize;
    int writable;
} arg_t;

/* Every argument taken as ``spec`` says. The first ``loose`` ones (a record's arrays) may be of
 * another type: 0, nothing held, the numpy path decides; the rest (the page model's columns)
 * must be theirs (ValueError). 1: all taken; -1: an error is set. */
static int take_args(PyObject *const *args, buf_t *b, const arg_t *spec, int n, int loose) {
    for (int i = 0; i < n; i++) {
        int got = take(args[i], &b[i], spec[i].kind, spec[i].itemsize, spec[i].writable, i >= loose, spec[i].name);
        if (got < 1) {
            release(b, i + 1);
            return got;
        }
    }
    return 1;
}

#define ITEMS(b, type) ((Py_ssize_t)((b).view.len / (Py_ssize_t)sizeof(type)))
#define DATA(b, type) ((type *)(b).view.buf)

/* ------------------------------------------------------------------ scratch bitmap */
/* one bit per page, all clear between calls: a batch's duplicate pages in one pass */
static uint64_t *seen_bits = NULL;
static Py_ssize_t seen_words = 0;

static int seen_room(Py_ssize_t num_pages) {
    Py_ssize_t words = (num_pages + 63) / 64;
    if (words <= seen_words)
        return 0;
    uint64_t *grown = PyMem_RawCalloc((size_t)words, sizeof(uint64_t));
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    PyMem_RawFree(seen_bits);
    seen_bits = grown;
    seen_words = words;
    return 0;
}

/* ------------------------------------------------------------------ key table */
/* KeyTable.find for one key: the leftmost match in the sorted index, else the first
 * match among the newest slots [indexed, len(keys)); key 0 is slot 0; -1 if none. */
static int64_t find_slot(uint64_t key, const uint64_t *sorted, const uint32_t *sorted_slot, Py_ssize_t n_sorted,
                         const uint64_t *slot_keys, Py_ssize_t n_keys, Py_ssize_t indexed) {
    if (key == 0)
        return 0;
    Py_ssize_t lo = 0, hi = n_sorted;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (sorted[mid] < key)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo < n_sorted && sorted[lo] == key)
        return sorted_slot[lo];
    for (Py_ssize_t s = indexed; s < n_keys; s++)
        if (slot_keys[s] == key)
            return s;
    return -1;
}

/* ------------------------------------------------------------------ decode_writes */
/* EngineTracker.decode_writes' numpy path (tracker.py), after its scope and HELLO checks:
 *
 *   one page per request (PagePool.one_page_each): as many pages as requests, counts at most 1,
 *     every page a real one the pool holds (PADDING_PAGE < page < num_pages);
 *   nothing to report (Judge.one_page_writes_bad): no page FREE, none OWNED by another
 *     request (owner key not the writer's and not 0);
 *   no page named twice (Judge.writes_overlap);
 *   every writer's key holds a slot (PagePool.slots would intern none);
 *
 * then marks as EngineTracker._mark_one_page_each: written_gen := gen where the state is
 * known, writer_slot := the writer's slot, last_write_ms := ms.
 *
 * Returns 1 (marked), 0 (not such a step: nothing done, the general path judges it) or
 * -1 (nothing done, the numpy path decides: a writer without a slot, which it interns, or
 * record arrays of other types than the wire's). */
static PyObject *decode_writes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    enum { REQ_KEYS, COUNTS, PAGES, STATE, OWNER_SLOT, SLOT_KEYS, GEN, WRITTEN_GEN, WRITER_SLOT, LAST_WRITE_MS,
           SORTED, SORTED_SLOT, NBUF };
    if (nargs != NBUF + 2) {
        PyErr_Format(PyExc_TypeError, "decode_writes takes %d arguments (%zd given)", NBUF + 2, nargs);
        return NULL;
    }
    static const arg_t spec[NBUF] = {
        {"req_keys", 'u', 8, 0}, {"write_counts", 'u', 4, 0}, {"write_pages", 'i', 4, 0}, {"state", 'u', 1, 0},
        {"owner_slot", 'u', 4, 0}, {"slot_keys", 'u', 8, 0}, {"gen", 'u', 4, 0}, {"written_gen", 'u', 4, 1},
        {"writer_slot", 'u', 4, 1}, {"last_write_ms", 'u', 4, 1}, {"sorted_keys", 'u', 8, 0},
        {"sorted_slots", 'u', 4, 0}
    };
    Py_ssize_t indexed = PyLong_AsSsize_t(args[NBUF]);
    long long ms = PyLong_AsLongLong(args[NBUF + 1]);
    if (PyErr_Occurred())
        return NULL;
    buf_t b[NBUF];
    memset(b, 0, sizeof(b));
    PyObject *result = NULL;
    long answer = 0;
    /* the record's arrays as decoded (u64 keys, u32 counts, i32 pages): others (a caller's own
     * arrays) take the numpy path; the pool's columns must be the pool's */
    int got = take_args(args, b, spec, NBUF, PAGES + 1);
    if (got < 0)
        goto done;
    if (got == 0) {
        answer = -1;
        goto answer;
    }
    Py_ssize_t num_pages = ITEMS(b[STATE], uint8_t);
    if (ITEMS(b[OWNER_SLOT], uint32_t) != num_pages || ITEMS(b[GEN], uint32_t) != num_pages ||
        ITEMS(b[WRITTEN_GEN], uint32_t) != num_pages || ITEMS(b[WRITER_SLOT], uint32_t) != num_pages ||
        ITEMS(b[LAST_WRITE_MS], uint32_t) != num_pages) {
        PyErr_SetString(PyExc_ValueError, "decode_writes: the pool's columns differ in length");
        goto done;
    }
    Py_ssize_t n_sorted = ITEMS(b[SORTED], uint64_t), n_keys = ITEMS(b[SLOT_KEYS], uint64_t);
    if (ITEMS(b[SORTED_SLOT], uint32_t) != n_sorted || indexed < 1 || indexed > n_keys || ms < 1 ||
        ms >= 0xFFFFFFFFLL) {
        PyErr_SetString(PyExc_ValueError, "decode_writes: inconsistent key table or write time");
        goto done;
    }
    Py_ssize_t n = ITEMS(b[REQ_KEYS], uint64_t);
    const uint64_t *keys = DATA(b[REQ_KEYS], uint64_t);
    const uint32_t *counts = DATA(b[COUNTS], uint32_t);
    const int32_t *pages = DATA(b[PAGES], int32_t);
    const uint8_t *state = DATA(b[STATE], uint8_t);
    const uint32_t *owner_slot = DATA(b[OWNER_SLOT], uint32_t);
    const uint64_t *slot_keys = DATA(b[SLOT_KEYS], uint64_t);
    const uint32_t *gen = DATA(b[GEN], uint32_t);
    uint32_t *written_gen = DATA(b[WRITTEN_GEN], uint32_t);
    uint32_t *writer_slot = DATA(b[WRITER_SLOT], uint32_t);
    uint32_t *last_write_ms = DATA(b[LAST_WRITE_MS], uint32_t);
    const uint64_t *sorted = DATA(b[SORTED], uint64_t);
    const uint32_t *sorted_slot = DATA(b[SORTED_SLOT], uint32_t);
    if (n == 0 || ITEMS(b[COUNTS], uint32_t) != n || ITEMS(b[PAGES], int32_t) != n)
        goto answer;
    /* the checks, nothing stored (counts: at most 1 and some 1, as one_page_each's max() == 1;
     * a decoded record's counts sum to its pages, so then each is 1) */
    uint32_t most = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t p = pages[i];
        if (counts[i] > most)
            most = counts[i];
        if (most > 1 || p <= PADDING_PAGE || p >= num_pages)
            goto answer;
        uint8_t st = state[p];
        if (st == ST_FREE)
            goto answer;
        if (st == ST_OWNED) {
            uint32_t os = owner_slot[p];
            if (os >= n_keys)
                goto answer; /* (the general path's lookup raises on it, as before) */
            uint64_t owner = slot_keys[os];
            if (owner != keys[i] && owner != 0)
                goto answer;
        }
    }
    if (most != 1)
        goto answer;
    if (n > 1) {
        if (seen_room(num_pages) < 0)
            goto done;
        int twice = 0;
        Py_ssize_t i = 0;
        for (; i < n; i++) {
            uint32_t p = (uint32_t)pages[i];
            uint64_t bit = 1ULL << (p & 63);
            if (seen_bits[p >> 6] & bit) {
                twice = 1;
                break;
            }
            seen_bits[p >> 6] |= bit;
        }
        for (Py_ssize_t j = 0; j < i; j++) /* leave the bitmap clear */
            seen_bits[(uint32_t)pages[j] >> 6] = 0;
        if (twice)
            goto answer;
    }
    /* every writer's slot, before the first store */
    uint32_t small[512];
    uint32_t *slots = n <= 512 ? small : PyMem_Malloc((size_t)n * sizeof(uint32_t));
    if (slots == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = (i > 0 && keys[i] == keys[i - 1]) ? slots[i - 1]
                                                       : find_slot(keys[i], sorted, sorted_slot, n_sorted, slot_keys,
                                                                   n_keys, indexed);
        if (s < 0) {
            answer = -1;
            break;
        }
        slots[i] = (uint32_t)s;
    }
    if (answer == 0) {
        for (Py_ssize_t i = 0; i < n; i++) {
            int32_t p = pages[i];
            if (state[p] != ST_UNKNOWN)
                written_gen[p] = gen[p];
            writer_slot[p] = slots[i];
            last_write_ms[p] = (uint32_t)ms;
        }
        answer = 1;
    }
    if (slots != small)
        PyMem_Free(slots);
answer:
    result = PyLong_FromLong(answer);
done:
    release(b, NBUF);
    return result;
}

/* ------------------------------------------------------------------ history_append */
/* History.append's column writes (history.py), after its count and its cut to the newest
 * ``capacity`` events: ``n`` events from ring position ``start`` on (wrapping), each value
 * either one for all of them or an array of n. Values are stored as numpy's setitem stores
 * them: array items and numpy scalars cast (wrapping), a Python int out of the column's
 * range raises OverflowError, as numpy 2 does, before anything is stored.
 * The events array's layout is history.EVENT_DTYPE's (checked there against LAYOUT). */
enum { EV_TS = 0, EV_KEY = 8, EV_ENGINE = 16, EV_PAGE = 20, EV_GEN = 24, EV_AUX = 28, EV_EVENT = 32, EV_POOL = 34,
       EV_SIZE = 40 };

typedef struct {
    buf_t b;
    const unsigned char *data; /* NULL: the one value `value` */
    char code;                 /* the array's format character */
    Py_ssize_t itemsize;
    uint64_t value; /* two's complement bits */
} src_t;

static const char *column_name(int offset) {
    switch (offset) {
    case EV_TS: return "int64";
    case EV_KEY: return "uint64";
    case EV_EVENT: return "uint8";
    case EV_POOL: return "uint16";
    case EV_PAGE: return "int32";
    default: return "uint32";
    }
}

/* A Python int's bits for column `offset`, range-checked as numpy does; -1 with an error set */
static int pyint_value(PyObject *obj, int offset, uint64_t *out) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow > 0 && offset == EV_KEY) {
        unsigned long long u = PyLong_AsUnsignedLongLong(obj);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
        } else {
            *out = u;
            return 0;
        }
    }
    int ok = !overflow;
    if (ok) {
        switch (offset) {
        case EV_TS: break;
        case EV_KEY: ok = v >= 0; break;
        case EV_EVENT: ok = v >= 0 && v <= 0xFF; break;
        case EV_POOL: ok = v >= 0 && v <= 0xFFFF; break;
        case EV_PAGE: ok = v >= INT32_MIN && v <= INT32_MAX; break;
        default: ok = v >= 0 && v <= 0xFFFFFFFFLL; break;
        }
    }
    if (!ok) {
        PyErr_Format(PyExc_OverflowError, "Python integer %S out of bounds for %s", obj, column_name(offset));
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

static inline uint64_t src_get(const src_t *s, Py_ssize_t i) {
    if (s->data == NULL)
        return s->value;
    const unsigned char *p = s->data + i * s->itemsize;
    switch (s->itemsize) {
    case 1: return s->code == 'b' ? (uint64_t)(int64_t) * (const int8_t *)p : *(const uint8_t *)p;
    case 2: return s->code == 'h' ? (uint64_t)(int64_t) * (const int16_t *)p : *(const uint16_t *)p;
    case 4: return (s->code == 'i' || s->code == 'l') ? (uint64_t)(int64_t) * (const int32_t *)p : *(const uint32_t *)p;
    default: return *(const uint64_t *)p;
    }
}

/* 1: `obj` read as a value for column `offset` (one value, or n of them); 0: something
 * else (the Python path stores it); -1: an error is set */
static int src_take(PyObject *obj, src_t *s, Py_ssize_t n, int offset) {
    memset(s, 0, sizeof(*s));
    if (PyLong_CheckExact(obj))
        return pyint_value(obj, offset, &s->value) < 0 ? -1 : 1;
    if (PyObject_GetBuffer(obj, &s->b.view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        if (!not_a_buffer())
            return -1;
        PyErr_Clear();
        return 0;
    }
    s->b.held = 1;
    const char *f = s->b.view.format ? s->b.view.format : "B";
    if (*f == '<' || *f == '=' || *f == '@' || *f == '|')
        f++;
    Py_ssize_t size = s->b.view.itemsize;
    int known = f[0] != 0 && f[1] == 0 && strchr("bhilqBHILQ?", f[0]) != NULL &&
                (size == 1 || size == 2 || size == 4 || size == 8);
    Py_ssize_t count = size > 0 ? s->b.view.len / size : 0;
    /* a numpy scalar (no dimensions) is one value; an array must hold exactly n */
    if (!known || !((s->b.view.ndim == 0 && count == 1) || (s->b.view.ndim == 1 && count == n)))
        return 0;
    s->code = f[0];
    s->itemsize = size;
    s->data = s->b.view.buf;
    if (s->b.view.ndim == 0) { /* one value for every event */
        s->value = src_get(s, 0);
        s->data = NULL;
    }
    return 1;
}

static PyObject *history_append(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    /* events, capacity, start, n, ts_ns, req_key, engine, pages, gens, aux, event, pool */
    if (nargs != 12) {
        PyErr_Format(PyExc_TypeError, "history_append takes 12 arguments (%zd given)", nargs);
        return NULL;
    }
    Py_ssize_t capacity = PyLong_AsSsize_t(args[1]), start = PyLong_AsSsize_t(args[2]), n = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred())
        return NULL;
    static const int offsets[8] = {EV_TS, EV_KEY, EV_ENGINE, EV_PAGE, EV_GEN, EV_AUX, EV_EVENT, EV_POOL};
    /* (pages None: -1; gens None: 0) */
    PyObject *values[8] = {args[4], args[5], args[6], args[7], args[8], args[9], args[10], args[11]};
    src_t src[8];
    buf_t events;
    memset(src, 0, sizeof(src));
    memset(&events, 0, sizeof(events));
    PyObject *result = NULL;
    int taken = 0;
    for (; taken < 8; taken++) {
        if (values[taken] == Py_None && (offsets[taken] == EV_PAGE || offsets[taken] == EV_GEN)) {
            memset(&src[taken], 0, sizeof(src_t));
            src[taken].value = offsets[taken] == EV_PAGE ? (uint64_t)(int64_t)-1 : 0;
            continue;
        }
        int got = src_take(values[taken], &src[taken], n, offsets[taken]);
        if (got < 0)
            goto done;
        if (got == 0) {
            result = Py_NewRef(Py_False);
            goto done;
        }
    }
    if (PyObject_GetBuffer(args[0], &events.view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    events.held = 1;
    if (capacity < 1 || events.view.len != capacity * EV_SIZE || start < 0 || start >= capacity || n < 0 ||
        n > capacity) {
        PyErr_SetString(PyExc_ValueError, "history_append: events, capacity, start and count disagree");
        goto done;
    }
    unsigned char *base = events.view.buf;
    Py_ssize_t at = start;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char *e = base + at * EV_SIZE;
        uint64_t v;
        v = src_get(&src[0], i); memcpy(e + EV_TS, &v, 8);
        v = src_get(&src[1], i); memcpy(e + EV_KEY, &v, 8);
        uint32_t w;
        w = (uint32_t)src_get(&src[2], i); memcpy(e + EV_ENGINE, &w, 4);
        w = (uint32_t)src_get(&src[3], i); memcpy(e + EV_PAGE, &w, 4);
        w = (uint32_t)src_get(&src[4], i); memcpy(e + EV_GEN, &w, 4);
        w = (uint32_t)src_get(&src[5], i); memcpy(e + EV_AUX, &w, 4);
        e[EV_EVENT] = (uint8_t)src_get(&src[6], i);
        uint16_t h = (uint16_t)src_get(&src[7], i); memcpy(e + EV_POOL, &h, 2);
        if (++at == capacity)
            at = 0;
    }
    result = Py_NewRef(Py_True);
done:
    for (int i = 0; i < 8; i++)
        if (src[i].b.held)
            PyBuffer_Release(&src[i].b.view);
    if (events.held)
        PyBuffer_Release(&events.view);
    return result;
}

static PyObject *history_layout(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    /* (field, offset) as EVENT_DTYPE must have them, and the itemsize */
    return Py_BuildValue("((si)(si)(si)(si)(si)(si)(si)(si))i", "ts_ns", EV_TS, "req_key", EV_KEY, "engine", EV_ENGINE,
                         "page", EV_PAGE, "gen", EV_GEN, "aux", EV_AUX, "event", EV_EVENT, "pool", EV_POOL, EV_SIZE);
}

/* ------------------------------------------------------------------ assign_run */
/* EngineTracker.on_assign_run's numpy path (tracker.py), after the rows' indexes of the run's
 * keys (``RowTable.indexes``: -1, no row): which one-page ASSIGNs of a run change nothing
 * (``nothing``), and which must be applied one by one, in order (``one_by_one``); both
 * bool arrays of the run's length, written here.
 *
 * An ASSIGN changes nothing when its request has a row, its positions lie within a row
 * (entry < row_limit, row_end <= row_limit * page_size), its page is one the pool holds,
 * it names the row's last entry and the page that entry holds, at the page's generation
 * with the same prefix-cache flag, and the page has nothing to claim (shared, or not
 * ALLOCATED). Then, if some change nothing and others do not: more than 32 that do not,
 * everything from the first of them on goes one by one; else every later ASSIGN of the
 * request of one that does not.
 *
 * Returns how many are to be applied one by one (``one_by_one``), or -1 (nothing done, the
 * numpy path decides: run columns not as the wire decodes them). */
static PyObject *assign_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    enum { IDX, KEYS, ROW_START, ROW_END, SHARED_UNTIL, PAGES, LENGTH, TAIL_PAGE, TAIL_GEN, GEN, STATE, NOTHING,
           ONE_BY_ONE, NBUF };
    if (nargs != NBUF + 2) {
        PyErr_Format(PyExc_TypeError, "assign_run takes %d arguments (%zd given)", NBUF + 2, nargs);
        return NULL;
    }
    static const arg_t spec[NBUF] = {
        {"idx", 'i', 8, 0}, {"req_keys", 'u', 8, 0}, {"row_start", 'u', 4, 0}, {"row_end", 'u', 4, 0},
        {"shared_until", 'u', 4, 0}, {"pages", 'i', 4, 0}, {"length", 'i', 8, 0}, {"tail_page", 'i', 8, 0},
        {"tail_gen_shared", 'u', 4, 0}, {"gen", 'u', 4, 0}, {"state", 'u', 1, 0}, {"nothing", '?', 1, 1},
        {"one_by_one", '?', 1, 1}
    };
    Py_ssize_t page_size = PyLong_AsSsize_t(args[NBUF]), row_limit = PyLong_AsSsize_t(args[NBUF + 1]);
    if (PyErr_Occurred())
        return NULL;
    buf_t b[NBUF];
    memset(b, 0, sizeof(b));
    PyObject *result = NULL;
    /* the run's columns as decoded (else -1: the numpy path); the rows' and the pool's must be theirs */
    int got = take_args(args, b, spec, NBUF, PAGES + 1);
    if (got < 0)
        goto done;
    if (got == 0) {
        result = PyLong_FromLong(-1);
        goto done;
    }
    Py_ssize_t n = ITEMS(b[IDX], int64_t);
    Py_ssize_t rows = ITEMS(b[LENGTH], int64_t), num_pages = ITEMS(b[GEN], uint32_t);
    if (ITEMS(b[KEYS], uint64_t) != n || ITEMS(b[ROW_START], uint32_t) != n || ITEMS(b[ROW_END], uint32_t) != n ||
        ITEMS(b[SHARED_UNTIL], uint32_t) != n || ITEMS(b[PAGES], int32_t) != n || ITEMS(b[NOTHING], uint8_t) != n ||
        ITEMS(b[ONE_BY_ONE], uint8_t) != n || ITEMS(b[TAIL_PAGE], int64_t) != rows ||
        ITEMS(b[TAIL_GEN], uint32_t) != rows || ITEMS(b[STATE], uint8_t) != num_pages || page_size < 1 ||
        row_limit < 0) {
        PyErr_SetString(PyExc_ValueError, "assign_run: the run's columns, the rows' or the pool's disagree");
        goto done;
    }
    const int64_t *idx = DATA(b[IDX], int64_t);
    const uint64_t *keys = DATA(b[KEYS], uint64_t);
    const uint32_t *row_start = DATA(b[ROW_START], uint32_t), *row_end = DATA(b[ROW_END], uint32_t);
    const uint32_t *shared_until = DATA(b[SHARED_UNTIL], uint32_t);
    const int32_t *pages = DATA(b[PAGES], int32_t);
    const int64_t *tail_page = DATA(b[TAIL_PAGE], int64_t), *length = DATA(b[LENGTH], int64_t);
    const uint32_t *tail_gen = DATA(b[TAIL_GEN], uint32_t);
    const uint32_t *gen = DATA(b[GEN], uint32_t);
    const uint8_t *state = DATA(b[STATE], uint8_t);
    uint8_t *nothing = DATA(b[NOTHING], uint8_t), *one_by_one = DATA(b[ONE_BY_ONE], uint8_t);
    Py_ssize_t n_nothing = 0, first = -1, n_first = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = idx[i];
        int32_t p = pages[i];
        uint64_t entry = row_start[i] / (uint64_t)page_size;
        int shared = row_start[i] < shared_until[i];
        int ok = r >= 0 && r < rows && entry < (uint64_t)row_limit &&
                 (uint64_t)row_end[i] <= (uint64_t)row_limit * (uint64_t)page_size && p >= 0 && p < num_pages &&
                 (int64_t)entry == length[r] - 1 && tail_page[r] == p &&
                 tail_gen[r] == (gen[p] | (shared ? SHARED_BIT : 0u)) && (shared || state[p] != ST_ALLOCATED);
        nothing[i] = (uint8_t)ok;
        one_by_one[i] = (uint8_t)!ok;
        if (ok)
            n_nothing++;
        else if (first < 0)
            first = i;
        if (!ok)
            n_first++;
    }
    if (n_nothing && n_first) {
        if (n_first > 32) {
            for (Py_ssize_t i = first; i < n; i++)
                one_by_one[i] = 1;
        } else {
            /* every later ASSIGN of the request of one that changes something (rare) */
            for (Py_ssize_t i = first; i < n; i++) {
                if (nothing[i])
                    continue;
                for (Py_ssize_t j = i + 1; j < n; j++)
                    if (keys[j] == keys[i])
                        one_by_one[j] = 1;
            }
        }
    }
    Py_ssize_t count = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        count += one_by_one[i];
    result = PyLong_FromSsize_t(count);
done:
    release(b, NBUF);
    return result;
}

/* ------------------------------------------------------------------ rows_as_seen */
/* Python slice [lo:hi) of an array of `len` items, clamped as Python clamps it (lo <= hi) */
static inline void clamp(int64_t *lo, int64_t *hi, int64_t len) {
    if (*lo > len)
        *lo = len;
    if (*hi > len)
        *hi = len;
    if (*hi < *lo)
        *hi = *lo;
}

/* np.array_equal(a[alo:ahi], b[blo:bhi]) for int32 arrays */
static int slices_equal(const int32_t *a, int64_t alo, int64_t ahi, int64_t alen, const int32_t *b, int64_t blo,
                        int64_t bhi, int64_t blen) {
    clamp(&alo, &ahi, alen);
    clamp(&blo, &bhi, blen);
    if (ahi - alo != bhi - blo)
        return 0;
    return ahi == alo || memcmp(a + alo, b + blo, (size_t)(ahi - alo) * 4) == 0;
}

/* Judge._rows_as_seen's comparisons (judge.py) for a batch whose rows changed at the
 * positions ``changed`` (ascending): the engine's rows of this forward (``actual``, row i
 * ``now_n[i]`` entries long, back to back) against those of the last forward found to be
 * the model (``before``, ``then_n``), one block per stretch of unchanged rows, and each
 * changed row against its model row (``model_rows``, a tuple: one array per changed row,
 * its first ``now_n[i]`` entries). The same slices and the same equality as the Python
 * loop. 1: all equal; 0: something differs; -1: arrays not of the expected types, or a
 * negative count (the numpy path decides). */
static PyObject *rows_as_seen(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    enum { ACTUAL, BEFORE, NOW_N, THEN_N, CHANGED, NBUF };
    if (nargs != NBUF + 1 || !PyTuple_Check(args[NBUF])) {
        PyErr_SetString(PyExc_TypeError, "rows_as_seen takes 5 arrays and a tuple of model rows");
        return NULL;
    }
    static const arg_t spec[NBUF] = {
        {"actual", 'i', 4, 0}, {"before", 'i', 4, 0}, {"now_n", 'i', 8, 0}, {"then_n", 'i', 8, 0},
        {"changed", 'i', 8, 0}
    };
    buf_t b[NBUF], row;
    memset(b, 0, sizeof(b));
    memset(&row, 0, sizeof(row));
    PyObject *result = NULL;
    int64_t *now_at = NULL, *then_at = NULL;
    long answer = -1;
    int got = take_args(args, b, spec, NBUF, NBUF);
    if (got < 0)
        goto done;
    if (got == 0)
        goto answer;
    Py_ssize_t n = ITEMS(b[NOW_N], int64_t), n_changed = ITEMS(b[CHANGED], int64_t);
    int64_t len_now = ITEMS(b[ACTUAL], int32_t), len_then = ITEMS(b[BEFORE], int32_t);
    PyObject *models = args[NBUF];
    if (ITEMS(b[THEN_N], int64_t) != n || PyTuple_GET_SIZE(models) != n_changed)
        goto answer;
    const int32_t *actual = DATA(b[ACTUAL], int32_t), *before = DATA(b[BEFORE], int32_t);
    const int64_t *now_n = DATA(b[NOW_N], int64_t), *then_n = DATA(b[THEN_N], int64_t);
    const int64_t *changed = DATA(b[CHANGED], int64_t);
    now_at = PyMem_Malloc((size_t)(n + 1) * sizeof(int64_t));
    then_at = PyMem_Malloc((size_t)(n + 1) * sizeof(int64_t));
    if (now_at == NULL || then_at == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    now_at[0] = then_at[0] = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (now_n[i] < 0 || then_n[i] < 0)
            goto answer;
        now_at[i + 1] = now_at[i] + now_n[i];
        then_at[i + 1] = then_at[i] + then_n[i];
    }
    for (Py_ssize_t k = 0; k < n_changed; k++) /* ascending, in range */
        if (changed[k] < 0 || changed[k] >= n || (k && changed[k] <= changed[k - 1]))
            goto answer;
    answer = 1;
    Py_ssize_t start = 0;
    for (Py_ssize_t k = 0; k < n_changed && answer == 1; k++) {
        Py_ssize_t i = (Py_ssize_t)changed[k];
        if (i > start &&
            !slices_equal(actual, now_at[start], now_at[i], len_now, before, then_at[start], then_at[i], len_then)) {
            answer = 0;
            break;
        }
        got = take(PyTuple_GET_ITEM(models, k), &row, 'i', 4, 0, 0, "model row");
        if (got < 0)
            goto done;
        if (got == 0) {
            answer = -1;
            break;
        }
        int64_t want = now_at[i + 1] - now_at[i];
        if (!slices_equal(actual, now_at[i], now_at[i + 1], len_now, DATA(row, int32_t), 0, want, ITEMS(row, int32_t)))
            answer = 0;
        PyBuffer_Release(&row.view);
        row.held = 0;
        start = i + 1;
    }
    if (answer == 1 && start < n &&
        !slices_equal(actual, now_at[start], len_now, len_now, before, then_at[start], len_then, len_then))
        answer = 0;
answer:
    result = PyLong_FromLong(answer);
done:
    release(b, NBUF);
    if (row.held)
        PyBuffer_Release(&row.view);
    PyMem_Free(now_at);
    PyMem_Free(then_at);
    return result;
}

/* list.append(int(v)); -1 with an error set */
static int append_long(PyObject *list, long long v) {
    PyObject *o = PyLong_FromLongLong(v);
    if (o == NULL)
        return -1;
    int r = PyList_Append(list, o);
    Py_DECREF(o);
    return r;
}

/* ------------------------------------------------------------------ alloc */
/* EngineTracker.on_alloc's numpy path (tracker.py) for ids the pool holds already: each
 * page's owner key before (``owners``, for PagePool.changed), its next generation
 * (``gens``: (gen + 1) & GEN_MASK, read before any is stored, so a page named twice gets
 * one increment, as numpy's fancy assignment gives), then gen, state ALLOCATED, owner slot 0.
 * 1: done; -1: an id out of the pool (or a slot out of the key table): nothing done, the
 * numpy path validates, grows and counts. */
static PyObject *alloc(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    enum { PAGES, STATE, GEN, OWNER_SLOT, SLOT_KEYS, OWNERS, GENS, NBUF };
    if (nargs != NBUF) {
        PyErr_Format(PyExc_TypeError, "alloc takes %d arguments (%zd given)", NBUF, nargs);
        return NULL;
    }
    static const arg_t spec[NBUF] = {
        {"pages", 'i', 4, 0}, {"state", 'u', 1, 1}, {"gen", 'u', 4, 1}, {"owner_slot", 'u', 4, 1},
        {"slot_keys", 'u', 8, 0}, {"owners", 'u', 8, 1}, {"gens", 'u', 4, 1}
    };
    buf_t b[NBUF];
    memset(b, 0, sizeof(b));
    PyObject *result = NULL;
    long answer = -1;
    int got = take_args(args, b, spec, NBUF, PAGES + 1);
    if (got < 0)
        goto done;
    if (got == 0)
        goto answer;
    Py_ssize_t n = ITEMS(b[PAGES], int32_t), num_pages = ITEMS(b[STATE], uint8_t);
    Py_ssize_t n_keys = ITEMS(b[SLOT_KEYS], uint64_t);
    if (ITEMS(b[GEN], uint32_t) != num_pages || ITEMS(b[OWNER_SLOT], uint32_t) != num_pages ||
        ITEMS(b[OWNERS], uint64_t) != n || ITEMS(b[GENS], uint32_t) != n) {
        PyErr_SetString(PyExc_ValueError, "alloc: the pool's columns or the outputs differ in length");
        goto done;
    }
    const int32_t *pages = DATA(b[PAGES], int32_t);
    uint8_t *state = DATA(b[STATE], uint8_t);
    uint32_t *gen = DATA(b[GEN], uint32_t), *owner_slot = DATA(b[OWNER_SLOT], uint32_t);
    const uint64_t *slot_keys = DATA(b[SLOT_KEYS], uint64_t);
    uint64_t *owners = DATA(b[OWNERS], uint64_t);
    uint32_t *gens = DATA(b[GENS], uint32_t);
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t p = pages[i];
        if (p < 0 || p >= num_pages || owner_slot[p] >= n_keys)
            goto answer;
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* everything read before anything is stored */
        int32_t p = pages[i];
        owners[i] = slot_keys[owner_slot[p]];
        gens[i] = (gen[p] + 1u) & GEN_MASK;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t p = pages[i];
        gen[p] = gens[i];
        state[p] = ST_ALLOCATED;
        owner_slot[p] = 0;
    }
    answer = 1;
answer:
    result = PyLong_FromLong(answer);
done:
    release(b, NBUF);
    return result;
}

/* ------------------------------------------------------------------ batch_rows */
/* Judge._batch's numpy part (judge.py), after the rows' indexes of a forward's keys (-1: no
 * row): whether each has a row (``has``), the index to read row scalars at (``at``: 0 for
 * those without), and the entries each reads (``n``: its seq_len in pages, rounded up, at
 * most the row's length, ``length[at]``). Returns 1 if every key has a row, 0 if not, -1
 * (nothing done, the numpy path) for seq_lens not as the wire decodes them (u32). */
static PyObject *batch_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    enum { IDX, SEQ_LENS, LENGTH, HAS, AT, N, NBUF };
    if (nargs != NBUF + 1) {
        PyErr_Format(PyExc_TypeError, "batch_rows takes %d arguments (%zd given)", NBUF + 1, nargs);
        return NULL;
    }
    static const arg_t spec[NBUF] = {
        {"idx", 'i', 8, 0}, {"seq_lens", 'u', 4, 0}, {"length", 'i', 8, 0}, {"has", '?', 1, 1},
        {"at", 'i', 8, 1}, {"n", 'i', 8, 1}
    };
    Py_ssize_t page_size = PyLong_AsSsize_t(args[NBUF]);
    if (page_size == -1 && PyErr_Occurred())
        return NULL;
    buf_t b[NBUF];
    memset(b, 0, sizeof(b));
    PyObject *result = NULL;
    long answer = -1;
    int got = take_args(args, b, spec, NBUF, SEQ_LENS + 1);
    if (got < 0)
        goto done;
    if (got == 0)
        goto answer;
    Py_ssize_t n = ITEMS(b[IDX], int64_t), rows = ITEMS(b[LENGTH], int64_t);
    if (ITEMS(b[SEQ_LENS], uint32_t) != n || ITEMS(b[HAS], uint8_t) != n || ITEMS(b[AT], int64_t) != n ||
        ITEMS(b[N], int64_t) != n || page_size < 1 || rows < 1) {
        PyErr_SetString(PyExc_ValueError, "batch_rows: the batch's arrays or the rows' disagree");
        goto done;
    }
    const int64_t *idx = DATA(b[IDX], int64_t), *length = DATA(b[LENGTH], int64_t);
    const uint32_t *seq_lens = DATA(b[SEQ_LENS], uint32_t);
    uint8_t *has = DATA(b[HAS], uint8_t);
    int64_t *at = DATA(b[AT], int64_t), *n_out = DATA(b[N], int64_t);
    for (Py_ssize_t i = 0; i < n; i++)
        if (idx[i] >= rows) /* (an index past the table: the numpy path raises, as before) */
            goto answer;
    answer = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = idx[i];
        has[i] = r >= 0;
        if (r < 0) {
            answer = 0;
            r = 0;
        }
        at[i] = r;
        int64_t need = ((int64_t)seq_lens[i] + page_size - 1) / page_size;
        n_out[i] = need < length[r] ? need : length[r];
    }
answer:
    result = PyLong_FromLong(answer);
done:
    release(b, NBUF);
    return result;
}

/* ------------------------------------------------------------------ clean_rows */
/* Judge._classify_changed's split of a batch (judge.py): the readers whose row's clean prefix
 * (clean_epoch == epoch) covers what they read (clean_n >= n) are clean; of them, those that
 * read exactly their prefix count its clean_reads, those that read less ("shorter") are
 * counted by the caller; the rest, with a row (``has``), are dirty. Returns (clean_reads,
 * shorter, dirty, dirty's clean_n, dirty's n, dirty's clean_epoch): the sum and lists of
 * ints, in batch order. */
static PyObject *clean_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    enum { AT, HAS, N, CLEAN_N, CLEAN_EPOCH, CLEAN_READS, NBUF };
    if (nargs != NBUF + 1) {
        PyErr_Format(PyExc_TypeError, "clean_rows takes %d arguments (%zd given)", NBUF + 1, nargs);
        return NULL;
    }
    static const arg_t spec[NBUF] = {
        {"at", 'i', 8, 0}, {"has", '?', 1, 0}, {"n", 'i', 8, 0}, {"clean_n", 'i', 8, 0},
        {"clean_epoch", 'i', 8, 0}, {"clean_reads", 'i', 8, 0}
    };
    long long epoch = PyLong_AsLongLong(args[NBUF]);
    if (epoch == -1 && PyErr_Occurred())
        return NULL;
    buf_t b[NBUF];
    memset(b, 0, sizeof(b));
    PyObject *result = NULL, *shorter = NULL, *d_i = NULL, *d_c = NULL, *d_n = NULL, *d_e = NULL;
    if (take_args(args, b, spec, NBUF, 0) < 1)
        goto done;
    Py_ssize_t n = ITEMS(b[AT], int64_t), rows = ITEMS(b[CLEAN_N], int64_t);
    if (ITEMS(b[HAS], uint8_t) != n || ITEMS(b[N], int64_t) != n || ITEMS(b[CLEAN_EPOCH], int64_t) != rows ||
        ITEMS(b[CLEAN_READS], int64_t) != rows) {
        PyErr_SetString(PyExc_ValueError, "clean_rows: the batch's arrays or the rows' disagree");
        goto done;
    }
    const int64_t *at = DATA(b[AT], int64_t), *n_all = DATA(b[N], int64_t);
    const int64_t *clean_n = DATA(b[CLEAN_N], int64_t), *clean_epoch = DATA(b[CLEAN_EPOCH], int64_t);
    const int64_t *clean_reads = DATA(b[CLEAN_READS], int64_t);
    const uint8_t *has = DATA(b[HAS], uint8_t);
    for (Py_ssize_t i = 0; i < n; i++)
        if (at[i] < 0 || at[i] >= rows) {
            PyErr_SetString(PyExc_ValueError, "clean_rows: a row index past the table");
            goto done;
        }
    if (!(shorter = PyList_New(0)) || !(d_i = PyList_New(0)) || !(d_c = PyList_New(0)) || !(d_n = PyList_New(0)) ||
        !(d_e = PyList_New(0)))
        goto done;
    long long sum = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!has[i])
            continue;
        int64_t r = at[i], c = clean_n[r], e = clean_epoch[r];
        if (e == epoch && c >= n_all[i]) {
            if (c == n_all[i])
                sum += clean_reads[r];
            else if (append_long(shorter, i) < 0)
                goto done;
        } else if (append_long(d_i, i) < 0 || append_long(d_c, c) < 0 || append_long(d_n, n_all[i]) < 0 ||
                   append_long(d_e, e) < 0) {
            goto done;
        }
    }
    result = Py_BuildValue("LOOOOO", sum, shorter, d_i, d_c, d_n, d_e);
done:
    Py_XDECREF(shorter);
    Py_XDECREF(d_i);
    Py_XDECREF(d_c);
    Py_XDECREF(d_n);
    Py_XDECREF(d_e);
    release(b, NBUF);
    return result;
}

/* ------------------------------------------------------------------ changes_scan */
/* One side of a page-change log entry: a list of Python ints (PagePool.changed_one) or an
 * array (PagePool.changed: int32 or int64 pages, uint64 owners). 1: read into `view`/`list`;
 * 0: something else; -1: an error is set. */
typedef struct {
    PyObject *list; /* borrowed; NULL for an array */
    Py_buffer view;
    int held;
    Py_ssize_t n, itemsize;
} side_t;

static int side_take(PyObject *obj, side_t *s, int is_pages) {
    memset(s, 0, sizeof(*s));
    if (PyList_CheckExact(obj)) {
        s->list = obj;
        s->n = PyList_GET_SIZE(obj);
        return 1;
    }
    if (PyObject_GetBuffer(obj, &s->view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        if (!not_a_buffer())
            return -1;
        PyErr_Clear();
        return 0;
    }
    s->held = 1;
    int ok = is_pages ? (kind_matches(&s->view, 'i', 4) || kind_matches(&s->view, 'i', 8))
                      : kind_matches(&s->view, 'u', 8);
    if (!ok)
        return 0;
    s->itemsize = s->view.itemsize;
    s->n = s->view.len / s->itemsize;
    return 1;
}

/* item i as a signed (pages) or unsigned (owners) 64-bit value; 0 with *bad set for a list
 * item that is not an int in range */
static inline uint64_t side_get(const side_t *s, Py_ssize_t i, int *bad) {
    if (s->list) {
        PyObject *o = PyList_GET_ITEM(s->list, i);
        if (!PyLong_CheckExact(o)) {
            *bad = 1;
            return 0;
        }
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow > 0) { /* an owner key past int64 */
            unsigned long long u = PyLong_AsUnsignedLongLong(o);
            if (u == (unsigned long long)-1 && PyErr_Occurred()) {
                PyErr_Clear();
                *bad = 1;
                return 0;
            }
            return u;
        }
        if (overflow || (v == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            *bad = 1;
            return 0;
        }
        return (uint64_t)v;
    }
    if (s->itemsize == 4)
        return (uint64_t)(int64_t)((const int32_t *)s->view.buf)[i];
    return ((const uint64_t *)s->view.buf)[i];
}

/* Judge._absorb_changes' first look at the page-change log (judge.py): 1 if a changed page
 * is one some row judged clean as a shared entry (``clean_shared``: every clean prefix is
 * void), else 2 if some changed page had an owner (the caller replays those into the rows),
 * else 0 (nothing to replay). -1: an entry the numpy path must read (other types, a page
 * outside ``clean_shared``). Reads the log; changes nothing. */
static PyObject *changes_scan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2 || !PyList_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "changes_scan takes the change log (a list) and clean_shared");
        return NULL;
    }
    buf_t shared;
    memset(&shared, 0, sizeof(shared));
    int got = take(args[1], &shared, '?', 1, 0, 1, "clean_shared");
    if (got < 1) {
        release(&shared, 1);
        return NULL;
    }
    const uint8_t *clean_shared = DATA(shared, uint8_t);
    Py_ssize_t num_pages = ITEMS(shared, uint8_t);
    PyObject *log = args[0];
    long answer = 0;
    int any_held = 0, any_hit = 0;
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(log) && answer == 0; k++) {
        PyObject *entry = PyList_GET_ITEM(log, k);
        side_t pages, owners;
        memset(&pages, 0, sizeof(pages));
        memset(&owners, 0, sizeof(owners));
        if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 2) {
            answer = -1;
            break;
        }
        int a = side_take(PyTuple_GET_ITEM(entry, 0), &pages, 1);
        int b = a == 1 ? side_take(PyTuple_GET_ITEM(entry, 1), &owners, 0) : 0;
        if (a < 0 || b < 0) {
            answer = -2; /* an error is set */
        } else if (a == 0 || b == 0 || pages.n != owners.n) {
            answer = -1;
        } else {
            int bad = 0;
            for (Py_ssize_t i = 0; i < pages.n; i++) {
                int64_t p = (int64_t)side_get(&pages, i, &bad);
                uint64_t owner = side_get(&owners, i, &bad);
                if (bad || p < 0 || p >= num_pages) {
                    answer = -1;
                    break;
                }
                any_hit |= clean_shared[p]; /* (read on: a page outside is the numpy path's, as it raises there) */
                any_held |= owner != 0;
            }
        }
        if (pages.held)
            PyBuffer_Release(&pages.view);
        if (owners.held)
            PyBuffer_Release(&owners.view);
    }
    release(&shared, 1);
    if (answer == -2)
        return NULL;
    return PyLong_FromLong(answer != 0 ? answer : any_hit ? 1 : any_held ? 2 : 0);
}

/* ------------------------------------------------------------------ assign_run_length */
/* engine_hooks/wire/decode.py's _assign_run, the part that decides how long the run of
 * back-to-back one-page ASSIGN records at ``pos`` is (the caller takes the columns): the same
 * header probes at run_min - 1, 2 * run_min - 1, 4 * run_min - 1, ... records on (a probe
 * must be an ASSIGN of 64 bytes with the next sequence number, compared without wrapping, as
 * Python ints compare), up to the first failing probe or ``run_max`` records; then every
 * record up to there checked as the numpy path checks them (word 0 as ``word0``: magic,
 * version, kind, length; the next sequence number, wrapping as uint64 subtraction does; the
 * first record's engine id and pool; one page; row_start <= shared_until <= row_end).
 * Returns the records in the run, or 0 where there are fewer than run_min. */
#define REC 64
static inline uint64_t word(const unsigned char *rec, int i) {
    uint64_t w;
    memcpy(&w, rec + 8 * i, 8);
    return w;
}

static PyObject *assign_run_length(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    /* buf, pos, end, kind ASSIGN, word0, run_min, run_max */
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "assign_run_length takes 7 arguments (%zd given)", nargs);
        return NULL;
    }
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]), end = PyLong_AsSsize_t(args[2]);
    long kind = PyLong_AsLong(args[3]);
    unsigned long long word0 = PyLong_AsUnsignedLongLong(args[4]);
    Py_ssize_t run_min = PyLong_AsSsize_t(args[5]), run_max = PyLong_AsSsize_t(args[6]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_ssize_t n = 0;
    if (pos < 0 || end > view.len || end < pos || run_min < 1 || run_max < run_min) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "assign_run_length: pos, end or the run bounds are out of range");
        return NULL;
    }
    const unsigned char *base = (const unsigned char *)view.buf + pos;
    Py_ssize_t avail = (end - pos) / REC;
    if (avail >= run_min) {
        uint64_t head_seq = word(base, 1);
#define PROBE_OK(k)                                                                                                    \
    (base[(k) * REC + 3] == (unsigned char)kind && (word(base + (k) * REC, 0) >> 32) == REC &&                      \
     head_seq <= UINT64_MAX - (uint64_t)(k) && word(base + (k) * REC, 1) == head_seq + (uint64_t)(k))
        if (PROBE_OK(run_min - 1)) {
            Py_ssize_t look = run_min, limit = avail < run_max ? avail : run_max;
            while (look < limit) {
                Py_ssize_t next = 2 * look < limit ? 2 * look : limit;
                look = next;
                if (!PROBE_OK(next - 1))
                    break;
            }
            uint64_t first_w3 = word(base, 3);
            const uint64_t engine_pool = (1ULL << 48) - 1;
            for (n = 0; n < look; n++) {
                const unsigned char *rec = base + n * REC;
                uint64_t w5 = word(rec, 5), w6 = word(rec, 6);
                uint32_t start = (uint32_t)w5, row_end = (uint32_t)(w5 >> 32), shared = (uint32_t)w6;
                if (word(rec, 0) != word0 || word(rec, 1) - head_seq != (uint64_t)n ||
                    ((word(rec, 3) ^ first_w3) & engine_pool) != 0 || (w6 >> 32) != 1 || start > shared ||
                    shared > row_end)
                    break;
            }
            if (n < run_min)
                n = 0;
        }
#undef PROBE_OK
    }
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(n);
}

/* ------------------------------------------------------------------ same_values */
/* np.array_equal for two 1-D integer arrays: 1 equal (as many items, each the same value),
 * 0 not; -1 where numpy would compare otherwise than as integers (a uint64 against a signed
 * array: numpy goes through float64) or for anything else (not 1-D, not contiguous, not
 * integers): the caller asks numpy. */
static int int_code(const Py_buffer *v, int *is_signed) {
    const char *f = v->format ? v->format : "B";
    if (*f == '<' || *f == '=' || *f == '@' || *f == '|')
        f++;
    if (f[0] == 0 || f[1] != 0 || v->ndim != 1)
        return 0;
    if (strchr("bhilq", f[0]))
        *is_signed = 1;
    else if (strchr("BHILQ", f[0]))
        *is_signed = 0;
    else
        return 0;
    return v->itemsize == 1 || v->itemsize == 2 || v->itemsize == 4 || v->itemsize == 8;
}

static inline int64_t load_signed(const unsigned char *p, Py_ssize_t size) {
    switch (size) {
    case 1: return *(const int8_t *)p;
    case 2: { int16_t v; memcpy(&v, p, 2); return v; }
    case 4: { int32_t v; memcpy(&v, p, 4); return v; }
    default: { int64_t v; memcpy(&v, p, 8); return v; }
    }
}

static inline uint64_t load_unsigned(const unsigned char *p, Py_ssize_t size) {
    switch (size) {
    case 1: return *p;
    case 2: { uint16_t v; memcpy(&v, p, 2); return v; }
    case 4: { uint32_t v; memcpy(&v, p, 4); return v; }
    default: { uint64_t v; memcpy(&v, p, 8); return v; }
    }
}

static PyObject *same_values(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "same_values takes two arrays");
        return NULL;
    }
    Py_buffer a, b;
    if (PyObject_GetBuffer(args[0], &a, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        if (!not_a_buffer())
            return NULL;
        PyErr_Clear();
        return PyLong_FromLong(-1);
    }
    if (PyObject_GetBuffer(args[1], &b, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&a);
        if (!not_a_buffer())
            return NULL;
        PyErr_Clear();
        return PyLong_FromLong(-1);
    }
    long answer = -1;
    int sa = 0, sb = 0;
    if (int_code(&a, &sa) && int_code(&b, &sb)) {
        Py_ssize_t n = a.len / a.itemsize;
        const unsigned char *pa = a.buf, *pb = b.buf;
        if (n != b.len / b.itemsize) {
            answer = 0;
        } else if (sa == sb && a.itemsize == b.itemsize) {
            answer = n == 0 || memcmp(pa, pb, (size_t)a.len) == 0;
        } else if (sa == sb && !sa) { /* both unsigned */
            answer = 1;
            for (Py_ssize_t i = 0; i < n && answer; i++)
                answer = load_unsigned(pa + i * a.itemsize, a.itemsize) == load_unsigned(pb + i * b.itemsize, b.itemsize);
        } else if (sa == sb || (!sa && a.itemsize < 8) || (!sb && b.itemsize < 8)) {
            /* both signed, or the unsigned one fits int64: compared as int64 */
            answer = 1;
            for (Py_ssize_t i = 0; i < n && answer; i++) {
                int64_t x = sa ? load_signed(pa + i * a.itemsize, a.itemsize)
                               : (int64_t)load_unsigned(pa + i * a.itemsize, a.itemsize);
                int64_t y = sb ? load_signed(pb + i * b.itemsize, b.itemsize)
                               : (int64_t)load_unsigned(pb + i * b.itemsize, b.itemsize);
                answer = x == y;
            }
        }
    }
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return PyLong_FromLong(answer);
}

/* ------------------------------------------------------------------ absent_keys */
/* The keys (uint64) at the positions ``mask`` selects that ``mapping`` (a dict keyed by int)
 * does not hold, in order, repeats kept: ``[k for k in keys[mask].tolist() if k not in mapping]``. */
static PyObject *absent_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3 || !PyDict_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "absent_keys takes keys, a mask and a dict");
        return NULL;
    }
    buf_t b[2];
    memset(b, 0, sizeof(b));
    PyObject *out = NULL;
    if (take(args[0], &b[0], 'u', 8, 0, 1, "keys") < 1 || take(args[1], &b[1], '?', 1, 0, 1, "mask") < 1)
        goto done;
    Py_ssize_t n = ITEMS(b[0], uint64_t);
    if (ITEMS(b[1], uint8_t) != n) {
        PyErr_SetString(PyExc_ValueError, "absent_keys: keys and mask differ in length");
        goto done;
    }
    const uint64_t *keys = DATA(b[0], uint64_t);
    const uint8_t *mask = DATA(b[1], uint8_t);
    if (!(out = PyList_New(0)))
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!mask[i])
            continue;
        PyObject *key = PyLong_FromUnsignedLongLong(keys[i]);
        if (key == NULL)
            goto fail;
        int held = PyDict_Contains(args[2], key);
        if (held < 0 || (!held && PyList_Append(out, key) < 0)) {
            Py_DECREF(key);
            goto fail;
        }
        Py_DECREF(key);
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    release(b, 2);
    return out;
}

/* ------------------------------------------------------------------ rows_changed */
/* Judge._rows_as_seen's first step (judge.py): each reader's row stamp now (``stamp[at]``,
 * into ``stamps``) and the positions, ascending, whose stamp or entries read differ from the
 * last forward's (into ``changed``; returned: how many). */
static PyObject *rows_changed(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    enum { AT, STAMP, SEEN_STAMPS, N, SEEN_N, STAMPS, CHANGED, NBUF };
    if (nargs != NBUF) {
        PyErr_Format(PyExc_TypeError, "rows_changed takes %d arguments (%zd given)", NBUF, nargs);
        return NULL;
    }
    static const arg_t spec[NBUF] = {
        {"at", 'i', 8, 0}, {"stamp", 'i', 8, 0}, {"seen_stamps", 'i', 8, 0}, {"n", 'i', 8, 0},
        {"seen_n", 'i', 8, 0}, {"stamps", 'i', 8, 1}, {"changed", 'i', 8, 1}
    };
    buf_t b[NBUF];
    memset(b, 0, sizeof(b));
    PyObject *result = NULL;
    if (take_args(args, b, spec, NBUF, 0) < 1)
        goto done;
    Py_ssize_t n = ITEMS(b[AT], int64_t), rows = ITEMS(b[STAMP], int64_t);
    if (ITEMS(b[SEEN_STAMPS], int64_t) != n || ITEMS(b[N], int64_t) != n || ITEMS(b[SEEN_N], int64_t) != n ||
        ITEMS(b[STAMPS], int64_t) != n || ITEMS(b[CHANGED], int64_t) != n) {
        PyErr_SetString(PyExc_ValueError, "rows_changed: the batch's arrays differ in length");
        goto done;
    }
    const int64_t *at = DATA(b[AT], int64_t), *stamp = DATA(b[STAMP], int64_t);
    const int64_t *seen_stamps = DATA(b[SEEN_STAMPS], int64_t), *now_n = DATA(b[N], int64_t);
    const int64_t *seen_n = DATA(b[SEEN_N], int64_t);
    int64_t *stamps = DATA(b[STAMPS], int64_t), *changed = DATA(b[CHANGED], int64_t);
    for (Py_ssize_t i = 0; i < n; i++)
        if (at[i] < 0 || at[i] >= rows) {
            PyErr_SetString(PyExc_ValueError, "rows_changed: a row index past the table");
            goto done;
        }
    Py_ssize_t count = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        stamps[i] = stamp[at[i]];
        if (stamps[i] != seen_stamps[i] || now_n[i] != seen_n[i])
            changed[count++] = i;
    }
    result = PyLong_FromSsize_t(count);
done:
    release(b, NBUF);
    return result;
}

static PyObject *abi(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLong(KVG_KERNELS_ABI);
}

static PyMethodDef methods[] = {
    {"decode_writes", (PyCFunction)(void (*)(void))decode_writes, METH_FASTCALL,
     "A decode step's writes judged and marked (1), not such a step (0) or a writer without a slot (-1)."},
    {"history_append", (PyCFunction)(void (*)(void))history_append, METH_FASTCALL,
     "History.append's column writes: True (stored) or False (a value for the Python path)."},
    {"history_layout", history_layout, METH_NOARGS, "The event layout history_append writes."},
    {"assign_run", (PyCFunction)(void (*)(void))assign_run, METH_FASTCALL,
     "A run of one-page ASSIGNs: which change nothing, which go one by one (their count; -1: the numpy path)."},
    {"rows_as_seen", (PyCFunction)(void (*)(void))rows_as_seen, METH_FASTCALL,
     "A batch's engine rows against the last forward's and the changed rows' model: 1 equal, 0 not, -1 numpy path."},
    {"alloc", (PyCFunction)(void (*)(void))alloc, METH_FASTCALL,
     "An ALLOC of ids the pool holds: owners before, next generations, marked (1); -1: the numpy path."},
    {"batch_rows", (PyCFunction)(void (*)(void))batch_rows, METH_FASTCALL,
     "A forward's readers against the rows: has, at, n; 1 all have rows, 0 not, -1 the numpy path."},
    {"clean_rows", (PyCFunction)(void (*)(void))clean_rows, METH_FASTCALL,
     "A batch split into clean reads, shorter reads and dirty rows (the incremental judge)."},
    {"changes_scan", (PyCFunction)(void (*)(void))changes_scan, METH_FASTCALL,
     "The page-change log: 1 a clean shared page changed, 2 owned pages changed, 0 neither, -1 numpy path."},
    {"assign_run_length", (PyCFunction)(void (*)(void))assign_run_length, METH_FASTCALL,
     "How many back-to-back one-page ASSIGN records at pos form a run (0: fewer than run_min)."},
    {"same_values", (PyCFunction)(void (*)(void))same_values, METH_FASTCALL,
     "np.array_equal of two 1-D integer arrays: 1, 0, or -1 (ask numpy)."},
    {"absent_keys", (PyCFunction)(void (*)(void))absent_keys, METH_FASTCALL,
     "The keys at the masked positions a dict does not hold, in order."},
    {"rows_changed", (PyCFunction)(void (*)(void))rows_changed, METH_FASTCALL,
     "A batch's row stamps now, and the positions whose stamp or entries read changed since the last forward."},
    {"abi", abi, METH_NOARGS, "The kernels' interface version."},
    {NULL, NULL, 0, NULL},
};

static void free_module(void *module) {
    (void)module;
    PyMem_RawFree(seen_bits);
    seen_bits = NULL;
    seen_words = 0;
}

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernels", "kvguard sidecar kernels (see kernels.c)", -1, methods, NULL, NULL, NULL,
    free_module,
};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
