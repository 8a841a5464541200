/* The serial link's impairments (impair.c) as core.c uses them. */
#ifndef SERIAL_IMPAIR_H
#define SERIAL_IMPAIR_H
#include <stdint.h>

enum { LOSS_NONE, LOSS_RANDOM, LOSS_GEMODEL, LOSS_STATE };

struct impairment_spec {     /* core.py's ImpairmentSpec: keep in step */
    int64_t delay_ns, jitter_ns, gap;
    const int32_t *table;    /* a distribution table of table_size values, or NULL: uniform */
    int32_t table_size, loss_kind;
    uint32_t delay_rho, duplicate, duplicate_rho, reorder, reorder_rho;
    uint32_t loss[5];        /* random: threshold, rho; gemodel: p, r, h, 1-k;
                                state: p13, p31, p32, p23, p14 */
};

struct copy {                /* one transmission of a frame */
    int64_t delay_ns;
    int reordered;
};

struct impairments;

struct impairments *serial_impairments(const struct impairment_spec *spec, const uint32_t *key,
                                       int key_length);
void serial_impairments_free(struct impairments *m);
/* The copies of the next frame that are sent (0-2), a duplicate first. */
int impair_frame(struct impairments *m, struct copy copies[2]);
#endif
