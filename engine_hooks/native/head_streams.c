/*
 * kvguard: transfer digest alg 3 (``head_streams``) for host KV pools, in place.
 *
 * The definition (docs/wire-format.md, "Transfer digests"): per (layer, kv head) one
 * xxh3-64 stream over that head's K bytes of every token in token order, one over its
 * V bytes; the digest is the sum of the streams' hashes mod 2**64. The Python path
 * (engine_hooks/digest.py) first gathers each head's rows into one contiguous buffer
 * and hashes that: one copy of every byte on top of the hash. Here each head's rows
 * are fed straight from the pool, so the copy is gone:
 *
 *  - rows whose length is a multiple of xxh3's 64-byte stripe are consumed in place
 *    with xxh3's own accumulate and scramble steps (from xxhash.h with
 *    XXH_INLINE_ALL), heads in tiles of tokens with the rows ahead prefetched (see
 *    TILE below); only the last row of each call is copied into the state's buffer,
 *    because xxh3 treats the stream's last bytes specially at digest time;
 *  - other row lengths are gathered a few KiB at a time into a stack buffer, which
 *    goes to the public XXH3_64bits_update.
 *
 * The stream hash does not depend on how its bytes were cut, so the states equal
 * the ones the public API would hold (engine_hooks/native/__init__.py checks that
 * against the Python xxhash package at load and refuses this library if not). The
 * in-place path relies on the state layout and stripe routine of xxhash 0.8.1 (the
 * version Debian 12 ships); with another xxhash.h the gathered path is compiled for
 * every row length instead.
 *
 * Nothing here allocates, locks or keeps global state: the caller owns the states
 * (64-byte aligned XXH3_state_t, kvg_state_size() bytes each) and the pool memory.
 */
#define XXH_INLINE_ALL
#include <xxhash.h>
#include <stdint.h>
#include <string.h>

#define KVG_ABI 3
#define STRIPE 64
#define BUFFER 256 /* XXH3_INTERNALBUFFER_SIZE */

#if XXH_VERSION_NUMBER >= 801 && XXH_VERSION_NUMBER < 802
#define KVG_IN_PLACE 1
#else
#define KVG_IN_PLACE 0
#endif

int kvg_abi(void) { return KVG_ABI; }
int kvg_in_place(void) { return KVG_IN_PLACE; }
int kvg_xxhash_version(void) { return (int)XXH_VERSION_NUMBER; }
size_t kvg_state_size(void) { return sizeof(XXH3_state_t); }

/* Reset ``n`` states (contiguous, kvg_state_size() apart) with their seeds. */
int kvg_reset(void *states, const uint64_t *seeds, int64_t n)
{
    XXH3_state_t *st = (XXH3_state_t *)states;
    for (int64_t i = 0; i < n; i++)
        if (XXH3_64bits_reset_withSeed(&st[i], seeds[i]) != XXH_OK)
            return -1;
    return 0;
}

/* The sum mod 2**64 of the ``n`` states' digests. */
uint64_t kvg_digest_sum(const void *states, int64_t n)
{
    const XXH3_state_t *st = (const XXH3_state_t *)states;
    uint64_t total = 0;
    for (int64_t i = 0; i < n; i++)
        total += XXH3_64bits_digest(&st[i]);
    return total;
}

/* Raw xxh3-64 of one buffer, as compiled here: the bench's same-build ceiling. */
uint64_t kvg_xxh3(const void *p, size_t len) { return XXH3_64bits(p, len); }

#if KVG_IN_PLACE
static void consume(XXH3_state_t *s, const uint8_t *p, size_t stripes)
{
    const uint8_t *secret = s->extSecret == NULL ? s->customSecret : s->extSecret;
    while (stripes) { /* at most one block per call: one scramble at most */
        size_t n = stripes < s->nbStripesPerBlock ? stripes : s->nbStripesPerBlock;
        XXH3_consumeStripes(s->acc, &s->nbStripesSoFar, s->nbStripesPerBlock, p, n, secret,
                            s->secretLimit, XXH3_accumulate_512, XXH3_scrambleAcc);
        p += n * STRIPE;
        stripes -= n;
    }
}

/* One row into its head's state, consumed in place (row_bytes % 64 == 0).
 * Mirrors XXH3_update: bytes are buffered while the stream fits the buffer (xxh3
 * hashes streams of <= 240 bytes from the buffer in one go); past that, every row
 * but the head's newest is consumed where it lies, and the newest waits (``pending``)
 * so that the stream's last stripe is still in the buffer when the digest is taken. */
static inline void row_in_place(XXH3_state_t *s, const uint8_t **pending, const uint8_t *row, size_t row_bytes)
{
    s->totalLen += row_bytes;
    if (*pending) {
        consume(s, *pending, row_bytes / STRIPE);
    } else if (s->bufferedSize + row_bytes <= BUFFER) {
        memcpy(s->buffer + s->bufferedSize, row, row_bytes);
        s->bufferedSize += (XXH32_hash_t)row_bytes;
        return;
    } else { /* the buffer holds whole rows, so whole stripes */
        consume(s, s->buffer, s->bufferedSize / STRIPE);
        s->bufferedSize = 0;
    }
    *pending = row;
}

/* The end of a call: keep the head's last <= 256 bytes (whole stripes) for the digest. */
static inline void finish_in_place(XXH3_state_t *s, const uint8_t *pending, size_t row_bytes)
{
    if (!pending)
        return;
    size_t keep = row_bytes <= BUFFER ? row_bytes : BUFFER;
    consume(s, pending, (row_bytes - keep) / STRIPE);
    memcpy(s->buffer, pending + (row_bytes - keep), keep);
    s->bufferedSize = (XXH32_hash_t)keep;
}

/* Measured on the bench's 128 MiB transfer (docs/performance.md "Digest"): a pool
 * larger than the caches makes the digest wait on memory, so the order of reads is
 * what counts. Token by token (TILE 1) reads the pool in order but reloads a head's
 * accumulators for every row; long tiles keep them in registers but read each head's
 * rows a whole token row apart, which the hardware prefetcher does not follow
 * (TILE 16: 0.55-0.7x of raw xxh3 on the same pages). TILE 2 with the rows AHEAD
 * tokens ahead prefetched: 0.7-1.3x of raw xxh3 over the same pages (which stalls at
 * every page it jumps to) depending on the machine's load, the best of the variants
 * tried side by side; 0.45-0.55x when everything is already in cache, where the
 * per-row switch between heads' states is what costs. */
#define HEAD_GROUP 32 /* heads fed together, tile by tile */
#ifndef TILE
#define TILE 2 /* tokens per tile */
#endif
#ifndef AHEAD
#define AHEAD 16 /* tokens ahead whose rows are prefetched */
#endif

static void update_in_place(XXH3_state_t *st, int64_t heads, const uint8_t *base, size_t row_bytes,
                            const int64_t *index, int64_t n)
{
    const size_t stripes = row_bytes / STRIPE;
    for (int64_t h0 = 0; h0 < heads; h0 += HEAD_GROUP) {
        int64_t hn = heads - h0 < HEAD_GROUP ? heads - h0 : HEAD_GROUP;
        const uint8_t *pending[HEAD_GROUP];
        int64_t t0[HEAD_GROUP], t_max = 0;
        XXH_ALIGN(XXH_ACC_ALIGN) xxh_u64 acc[HEAD_GROUP][XXH_ACC_NB];
        size_t so_far[HEAD_GROUP];
        const uint8_t *secret[HEAD_GROUP]; /* each seed derives its own secret */
        for (int64_t h = 0; h < hn; h++) { /* each head's buffered start, as XXH3_update would */
            XXH3_state_t *s = &st[h0 + h];
            const int64_t *rows = index + (h0 + h) * n;
            int64_t t = 0;
            pending[h] = NULL;
            while (t < n && !pending[h])
                row_in_place(s, &pending[h], base + (size_t)rows[t++] * row_bytes, row_bytes);
            t0[h] = t;
            if (t > t_max)
                t_max = t;
            memcpy(acc[h], s->acc, sizeof(acc[h]));
            so_far[h] = s->nbStripesSoFar;
            secret[h] = s->extSecret == NULL ? s->customSecret : s->extSecret;
            s->totalLen += (XXH64_hash_t)row_bytes * (XXH64_hash_t)(n - t);
        }
        const size_t per_block = st[h0].nbStripesPerBlock, secret_limit = st[h0].secretLimit; /* seed-independent */
        /* Tiles of TILE tokens: each head takes the tile's rows with its accumulators in
         * registers, and the tile (TILE rows of every head) stays in cache meanwhile. */
        for (int64_t ta = 0; ta < n; ta += TILE) {
            int64_t tb = n - ta < TILE ? n : ta + TILE;
            /* the next tile's rows, ahead of time: within a tile each head reads rows
             * a whole token row apart, which the hardware prefetcher does not follow */
            for (int64_t t = ta + AHEAD; t < tb + AHEAD && t < n; t++)
                for (int64_t h = 0; h < hn; h++)
                    for (size_t j = 0; j < stripes; j++)
                        XXH_PREFETCH(base + (size_t)index[(h0 + h) * n + t] * row_bytes + j * STRIPE);
            for (int64_t h = 0; h < hn; h++) {
                int64_t t = ta > t0[h] ? ta : t0[h];
                if (t >= tb)
                    continue;
                const int64_t *rows = index + (h0 + h) * n;
                const uint8_t *p = pending[h], *sec = secret[h];
                XXH_ALIGN(XXH_ACC_ALIGN) xxh_u64 a[XXH_ACC_NB];
                size_t k = so_far[h];
                memcpy(a, acc[h], sizeof(a));
                for (; t < tb; t++) { /* consume the pending row, the new one waits */
                    for (size_t j = 0; j < stripes; j++) {
                        XXH3_accumulate_512(a, p + j * STRIPE, sec + k * XXH_SECRET_CONSUME_RATE);
                        if (++k == per_block) {
                            XXH3_scrambleAcc(a, sec + secret_limit);
                            k = 0;
                        }
                    }
                    p = base + (size_t)rows[t] * row_bytes;
                }
                memcpy(acc[h], a, sizeof(a));
                so_far[h] = k;
                pending[h] = p;
            }
        }
        for (int64_t h = 0; h < hn; h++) {
            XXH3_state_t *s = &st[h0 + h];
            memcpy(s->acc, acc[h], sizeof(acc[h]));
            s->nbStripesSoFar = so_far[h];
            finish_in_place(s, pending[h], row_bytes);
        }
    }
}
#endif

/* Rows whose length is not a stripe multiple (small test models): gathered per head
 * into a local buffer, which goes to XXH3_64bits_update a few KiB at a time (one
 * update per row measured slower than the numpy gather this replaces). */
#define GATHER_BYTES 4096

static void update_gathered(XXH3_state_t *st, int64_t heads, const uint8_t *base, size_t row_bytes,
                            const int64_t *index, int64_t n)
{
    uint8_t buf[GATHER_BYTES];
    for (int64_t h = 0; h < heads; h++) {
        const int64_t *rows = index + h * n;
        size_t used = 0;
        for (int64_t t = 0; t < n; t++) {
            const uint8_t *row = base + (size_t)rows[t] * row_bytes;
            if (row_bytes > GATHER_BYTES) { /* a long row: no gain from copying it */
                XXH3_64bits_update(&st[h], row, row_bytes);
                continue;
            }
            if (used + row_bytes > GATHER_BYTES) {
                XXH3_64bits_update(&st[h], buf, used);
                used = 0;
            }
            switch (row_bytes) { /* fixed sizes inline; a libc call per small row costs more than the copy */
            case 16: memcpy(buf + used, row, 16); break;
            case 32: memcpy(buf + used, row, 32); break;
            case 48: memcpy(buf + used, row, 48); break;
            default: memcpy(buf + used, row, row_bytes);
            }
            used += row_bytes;
        }
        if (used)
            XXH3_64bits_update(&st[h], buf, used);
    }
}

static void update_rows(XXH3_state_t *st, int64_t heads, const uint8_t *base, size_t row_bytes,
                        const int64_t *index, int64_t n)
{
#if KVG_IN_PLACE
    if (row_bytes % STRIPE == 0) {
        update_in_place(st, heads, base, row_bytes, index, n);
        return;
    }
#endif
    update_gathered(st, heads, base, row_bytes, index, n);
}

/* The largest row ``index`` names, or -1 if one is negative. */
static int64_t max_row(const int64_t *index, int64_t count)
{
    int64_t top = 0;
    for (int64_t i = 0; i < count; i++) {
        if (index[i] < 0)
            return -1;
        if (index[i] > top)
            top = index[i];
    }
    return top;
}

/*
 * Feed rows of ``count`` flat ``[n_rows, row_bytes]`` buffers (every layer's K and V:
 * one call per block of tokens): buffer k starts at ``bases[k]``, holds ``n_rows[k]``
 * rows of ``row_bytes[k]``, and feeds states ``firsts[k] .. firsts[k] + heads``; head
 * h takes rows ``index[h*n .. h*n + n)`` of each buffer in that order (index is
 * head-major, ``[heads, n]``, as PoolView.row_index builds it). Checked before
 * anything is touched: -1 if a row is negative or past a buffer.
 */
int kvg_update_buffers(void *states, int64_t heads, int64_t count, const uint64_t *bases, const int64_t *n_rows,
                       const int64_t *row_bytes, const int64_t *firsts, const int64_t *index, int64_t n)
{
    XXH3_state_t *st = (XXH3_state_t *)states;
    int64_t top = max_row(index, heads * n);
    if (top < 0)
        return -1;
    for (int64_t k = 0; k < count && n > 0; k++)
        if (top >= n_rows[k])
            return -1;
    for (int64_t k = 0; k < count; k++)
        update_rows(st + firsts[k], heads, (const uint8_t *)(uintptr_t)bases[k], (size_t)row_bytes[k], index, n);
    return 0;
}

/* The bench's ceiling for a transfer: raw xxh3-64 of ``n`` blocks of ``block_bytes``
 * at ``base + offsets[i]`` (each page's K or V block as it lies in the pool), summed;
 * the same bytes the digest reads, with no per-call cost from Python. */
uint64_t kvg_xxh3_blocks(const void *base, int64_t block_bytes, const int64_t *offsets, int64_t n)
{
    uint64_t total = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i + 1 < n) /* the next block ahead of time, as the digest prefetches its rows */
            for (int64_t off = 0; off < block_bytes; off += STRIPE)
                XXH_PREFETCH((const uint8_t *)base + offsets[i + 1] + off);
        total += XXH3_64bits((const uint8_t *)base + offsets[i], (size_t)block_bytes);
    }
    return total;
}
