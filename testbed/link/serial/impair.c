/* netem's impairment model for the serial link's C core: the draws of
 * testbed/link/serial/netem_draws.py, number for number.
 *
 * Each generator is CPython's (MT19937 seeded by init_by_array with the key `random.seed`
 * makes of the seed: its 32-bit words, least significant first), and every draw is taken in
 * the order the Python classes take theirs, so that a port meets the same realisation
 * whichever loop serves it; tests/unit/test_serial_core.py compares the two frame by frame.
 * The program builds a `struct impairment_spec` from the Python `Impairments` (which checked
 * the parameters and turned them into netem's thresholds) and hands it here.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "impair.h"

#define MT_N 624
#define MT_M 397
#define DIST_SCALE 8192  /* NETEM_DIST_SCALE */

struct correlated {
    uint32_t rho, last;  /* rho: the correlation's threshold; last: the previous draw */
};

struct impairments {
    uint32_t mt[MT_N];
    int mti;
    int64_t mu, sigma;
    int32_t *table;
    int table_size;
    struct correlated delay_random, loss_random, duplicate_random, reorder_random;
    int loss_kind, state;
    uint32_t loss[5];
    uint32_t duplicate, reorder;
    int64_t gap, counter;
};

/* CPython's _randommodule.c: init_genrand, init_by_array, genrand_uint32. */
static void init_genrand(struct impairments *m, uint32_t s) {
    m->mt[0] = s;
    for (int i = 1; i < MT_N; i++)
        m->mt[i] = 1812433253U * (m->mt[i - 1] ^ (m->mt[i - 1] >> 30)) + (uint32_t)i;
    m->mti = MT_N;
}

static void init_by_array(struct impairments *m, const uint32_t *key, int length) {
    init_genrand(m, 19650218U);
    int i = 1, j = 0;
    for (int k = MT_N > length ? MT_N : length; k; k--) {
        m->mt[i] = (m->mt[i] ^ ((m->mt[i - 1] ^ (m->mt[i - 1] >> 30)) * 1664525U)) + key[j] + (uint32_t)j;
        i++, j++;
        if (i >= MT_N) m->mt[0] = m->mt[MT_N - 1], i = 1;
        if (j >= length) j = 0;
    }
    for (int k = MT_N - 1; k; k--) {
        m->mt[i] = (m->mt[i] ^ ((m->mt[i - 1] ^ (m->mt[i - 1] >> 30)) * 1566083941U)) - (uint32_t)i;
        i++;
        if (i >= MT_N) m->mt[0] = m->mt[MT_N - 1], i = 1;
    }
    m->mt[0] = 0x80000000U;
}

static uint32_t genrand(struct impairments *m) {
    static const uint32_t mag01[2] = {0, 0x9908b0dfU};
    uint32_t y;
    if (m->mti >= MT_N) {
        int k;
        for (k = 0; k < MT_N - MT_M; k++) {
            y = (m->mt[k] & 0x80000000U) | (m->mt[k + 1] & 0x7fffffffU);
            m->mt[k] = m->mt[k + MT_M] ^ (y >> 1) ^ mag01[y & 1];
        }
        for (; k < MT_N - 1; k++) {
            y = (m->mt[k] & 0x80000000U) | (m->mt[k + 1] & 0x7fffffffU);
            m->mt[k] = m->mt[k + (MT_M - MT_N)] ^ (y >> 1) ^ mag01[y & 1];
        }
        y = (m->mt[MT_N - 1] & 0x80000000U) | (m->mt[0] & 0x7fffffffU);
        m->mt[MT_N - 1] = m->mt[MT_M - 1] ^ (y >> 1) ^ mag01[y & 1];
        m->mti = 0;
    }
    y = m->mt[m->mti++];
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680U;
    y ^= (y << 15) & 0xefc60000U;
    y ^= y >> 18;
    return y;
}

/* netem's get_crandom (impairments.Correlated). */
static void correlated_init(struct impairments *m, struct correlated *c, uint32_t rho) {
    c->rho = rho;
    c->last = genrand(m);
}

static uint32_t correlated_draw(struct impairments *m, struct correlated *c) {
    uint32_t value = genrand(m);
    if (c->rho == 0) return value;
    unsigned __int128 rho = (unsigned __int128)c->rho + 1, full = (unsigned __int128)1 << 32;
    c->last = (uint32_t)(((unsigned __int128)value * (full - rho) + (unsigned __int128)c->last * rho) >> 32);
    return c->last;
}

/* netem's tabledist (impairments.Delay), clipped at zero as Impairments._path does. */
static int64_t delay_draw(struct impairments *m) {
    if (m->sigma == 0) return m->mu > 0 ? m->mu : 0;
    uint32_t rnd = correlated_draw(m, &m->delay_random);
    int64_t delay;
    if (m->table == NULL) {
        delay = (int64_t)(rnd % (uint64_t)(2 * m->sigma)) + m->mu - m->sigma;
    } else {
        int64_t t = m->table[rnd % (uint32_t)m->table_size];
        int64_t x = (m->sigma % DIST_SCALE) * t;
        x += x >= 0 ? DIST_SCALE / 2 : -(DIST_SCALE / 2);
        delay = x / DIST_SCALE + (m->sigma / DIST_SCALE) * t + m->mu;
    }
    return delay > 0 ? delay : 0;
}

/* impairments.RandomLoss, GilbertElliott, FourState. */
static int lost(struct impairments *m) {
    uint32_t *q = m->loss;
    switch (m->loss_kind) {
    case LOSS_RANDOM:
        return q[0] && q[0] >= correlated_draw(m, &m->loss_random);
    case LOSS_GEMODEL: /* p, r, h, 1-k; state 1 good, 2 bad */
        if (m->state == 1) {
            if (genrand(m) < q[0]) m->state = 2;
            return genrand(m) < q[3];
        }
        if (genrand(m) < q[1]) m->state = 1;
        return genrand(m) > q[2];
    case LOSS_STATE: { /* p13, p31, p32, p23, p14; 1 sent in a gap, 2 sent in a burst,
                          3 lost in a burst, 4 an isolated loss */
        uint32_t rnd = genrand(m);
        switch (m->state) {
        case 1:
            if (rnd < q[4]) return m->state = 4, 1;
            if (rnd < (uint64_t)q[0] + q[4]) return m->state = 3, 1;
            return 0;
        case 2:
            if (rnd < q[3]) return m->state = 3, 1;
            return 0;
        case 3:
            if (rnd < q[2]) return m->state = 2, 0;
            if (rnd < (uint64_t)q[1] + q[2]) return m->state = 1, 0;
            return 1;
        default:
            m->state = 1;
            return 0;
        }
    }
    default:
        return 0;
    }
}

/* impairments.Impairments._path: netem's reorder decision, then the delay. */
static struct copy path(struct impairments *m) {
    struct copy copy = {0, 0};
    if (m->gap == 0 || m->counter < m->gap - 1 ||
        m->reorder < correlated_draw(m, &m->reorder_random)) {
        m->counter++;
        copy.delay_ns = delay_draw(m);
    } else {
        m->counter = 0;
        copy.reordered = 1;
    }
    return copy;
}

int impair_frame(struct impairments *m, struct copy copies[2]) {
    int count = 1, sent = 0;
    if (m->duplicate && m->duplicate >= correlated_draw(m, &m->duplicate_random)) count++;
    if (m->loss_kind && lost(m)) count--;
    if (count > 1 && !(m->loss_kind && lost(m))) copies[sent++] = path(m);
    if (count > 0) copies[sent++] = path(m);
    return sent;
}

struct impairments *serial_impairments(const struct impairment_spec *spec, const uint32_t *key,
                                       int key_length) {
    if (key_length < 1 || spec->jitter_ns < 0 || spec->loss_kind < 0 || spec->loss_kind > 3 ||
        (spec->table_size > 0) != (spec->table != NULL) || spec->table_size < 0)
        return NULL;
    struct impairments *m = calloc(1, sizeof *m);
    if (m == NULL) return NULL;
    if (spec->table_size > 0) {
        m->table = malloc(sizeof(int32_t) * (size_t)spec->table_size);
        if (m->table == NULL) return free(m), NULL;
        memcpy(m->table, spec->table, sizeof(int32_t) * (size_t)spec->table_size);
        m->table_size = spec->table_size;
    }
    init_by_array(m, key, key_length);
    m->mu = spec->delay_ns, m->sigma = spec->jitter_ns;
    memcpy(m->loss, spec->loss, sizeof m->loss);
    m->loss_kind = spec->loss_kind;
    m->state = 1;
    m->duplicate = spec->duplicate, m->reorder = spec->reorder, m->gap = spec->gap;
    /* the order in which Impairments.__init__ builds its correlated generators */
    correlated_init(m, &m->delay_random, spec->delay_rho);
    if (m->loss_kind == LOSS_RANDOM) correlated_init(m, &m->loss_random, spec->loss[1]);
    correlated_init(m, &m->duplicate_random, spec->duplicate_rho);
    correlated_init(m, &m->reorder_random, spec->reorder_rho);
    return m;
}

void serial_impairments_free(struct impairments *m) {
    if (m == NULL) return;
    free(m->table);
    free(m);
}

/* The next `frames` frames' copies, for the tests: counts[f] copies each, their delays and
 * reorder flags two by two in delays_ns and reordered. */
void serial_impair_draw(struct impairments *m, int frames, int *counts, int64_t *delays_ns,
                        int *reordered) {
    for (int f = 0; f < frames; f++) {
        struct copy copies[2] = {{0, 0}, {0, 0}};
        counts[f] = impair_frame(m, copies);
        for (int c = 0; c < 2; c++) {
            delays_ns[2 * f + c] = copies[c].delay_ns;
            reordered[2 * f + c] = copies[c].reordered;
        }
    }
}
