/* The serial link's per-frame core (testbed.link.serial.core builds it, the program calls it).
 *
 * One thread per port runs serial_serve(port): read a frame with its kernel receive
 * timestamp, schedule it on the port's line (start = max(arrival, the previous frame's
 * scheduled end), end = start + wire time at the least of the sender's uplink, the receiver's
 * downlink and the pair's rate), sleep until the end, forward it, count it: the schedule and
 * the counters of the Python loop in program.py, without the interpreter on the frame's path
 * and without its lock between ports. The Python program opens the sockets, sets the rates
 * and the impairments and reads the counters. With serial_spin(ns), a frame that ends a
 * message (ends_message) sleeps until `ns` before its departure and polls the clock from
 * there (program.py, "Waiting").
 *
 * A port with impairments (its uplink's, or later hops': a receiver's downlink, a pair;
 * impair.c draws them as netem_draws.py does) serves its frames as port.py's Port.serve
 * does: each copy a frame is sent as gets its time in a heap of pending frames, and the
 * port reads ahead (polls its socket until the head is due) where one frame may overtake
 * another (serial_mode).
 *
 * On a shared medium (serial_medium: a cell, program.py's "Shared medium") every port's
 * frames take one line, the cell's: a frame's slot starts at the later of its arrival and
 * the end of the last slot any port took, and lasts the airtime overhead plus its wire time
 * at its sender's rate. A port takes its next slot only once its previous one has ended, so
 * stations with frames waiting take turns frame by frame. Impairments come after the air.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/if_packet.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "impair.h"

#define MAX_PORTS 64
#define MAX_MACS 1024
#define STALL_LOG 10000
#define EVENT_LOG 100000              /* impairment events kept with their times (port.py's) */
#define MAX_FAN 4                     /* copies of one frame after two hops that duplicate */
#define FRAME_BUFFER 65536
#define STALL_NS 1000000LL            /* a frame this late was held up by the machine */
#define SANITY_NS 60000000000LL       /* a timestamp further than this from now is unusable */
#ifndef SO_TIMESTAMPNS_OLD
#define SO_TIMESTAMPNS_OLD 35
#endif
#ifndef SO_TIMESTAMPNS_NEW
#define SO_TIMESTAMPNS_NEW 64
#endif

struct counters {              /* read by the program through ctypes: keep in step */
    uint64_t frames, bytes, send_errors, stalls, stall_logged, clock_fallbacks;
    int64_t queued_ns_sum, queued_ns_max, late_ns_sum, late_ns_max, stalled_ns;
    uint64_t lost, duplicated, reordered, queue_drops, event_logged;
};

enum { LOST, DUPLICATED, REORDERED }; /* port.py's IMPAIRED */

struct pending {               /* a copy of a frame waiting to be sent at `due` */
    int64_t due, queued;
    uint64_t order;
    unsigned char *frame;
    int size;
};

struct port {
    int fd;
    volatile double rate_bit_s, down_bit_s; /* down 0: unshaped */
    int64_t free_at_ns;
    int64_t sent_after_ns;     /* on a cell: the last delayed copy's time, kept in order */
    int stalling;
    struct counters counters;
    int64_t stall_start_ns[STALL_LOG], stall_ns[STALL_LOG]; /* a ring */
    int64_t event_ns[EVENT_LOG];  /* a ring, with event_code */
    unsigned char event_code[EVENT_LOG];
    pthread_mutex_t lock;      /* the counters and the rings, against a reader */
    struct impairments *up;    /* its uplink's, under up_lock */
    struct impairments *down;  /* what its device receives meets, under hop_lock */
    pthread_mutex_t up_lock;
    volatile int reads_ahead, hops, queue_limit;
    struct pending *pending;   /* a heap by (due, order), of pending_room */
    int pending_count, pending_room;
    uint64_t order;
};

static struct port ports[MAX_PORTS];
static int port_count;
static volatile double pair_bit_s[MAX_PORTS][MAX_PORTS]; /* 0: none */
static volatile int pairs_set;
static volatile int64_t spin_ns;  /* a frame that ends a message polls its last spin_ns */
static struct impairments *pair_hops[MAX_PORTS][MAX_PORTS]; /* under hop_lock */
static pthread_mutex_t hop_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned char macs[MAX_MACS][6];
static int mac_port[MAX_MACS];
static int mac_count;
static pthread_mutex_t mac_lock = PTHREAD_MUTEX_INITIALIZER;
static volatile int shared;              /* 1: one line (the cell) for every port's frames */
static volatile int64_t airtime_ns;      /* what each frame adds on it (preamble, MAC) */
static int64_t cell_free_at_ns;          /* the end of the last slot taken, under cell_lock */
static pthread_mutex_t cell_lock = PTHREAD_MUTEX_INITIALIZER;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

size_t serial_counters_size(void) { return sizeof(struct counters); }

int serial_init(int count) {
    if (count < 1 || count > MAX_PORTS) return -EINVAL;
    port_count = count;
    cell_free_at_ns = 0;
    for (int i = 0; i < count; i++) {
        serial_impairments_free(ports[i].up);
        serial_impairments_free(ports[i].down);
        free(ports[i].pending);
        for (int j = 0; j < MAX_PORTS; j++) serial_impairments_free(pair_hops[i][j]), pair_hops[i][j] = NULL;
        memset(&ports[i], 0, sizeof ports[i]);
        ports[i].fd = -1;
        ports[i].queue_limit = 32;
        pthread_mutex_init(&ports[i].lock, NULL);
        pthread_mutex_init(&ports[i].up_lock, NULL);
    }
    return 0;
}

int serial_port(int index, int fd, double rate_bit_s) {
    if (index < 0 || index >= port_count || rate_bit_s <= 0) return -EINVAL;
    ports[index].fd = fd;
    ports[index].rate_bit_s = rate_bit_s;
    return 0;
}

int serial_rate(int index, double rate_bit_s) {
    if (index < 0 || index >= port_count || rate_bit_s <= 0) return -EINVAL;
    ports[index].rate_bit_s = rate_bit_s;
    return 0;
}

int serial_down(int index, double rate_bit_s) {
    if (index < 0 || index >= port_count || rate_bit_s < 0) return -EINVAL;
    ports[index].down_bit_s = rate_bit_s;
    return 0;
}

/* Every port's frames on one shared line from the next frame on (`on`), each with
 * `overhead_ns` of airtime besides its wire time; or a line per port (0). */
int serial_medium(int on, int64_t overhead_ns) {
    if (overhead_ns < 0 || (!on && overhead_ns)) return -EINVAL;
    pthread_mutex_lock(&cell_lock);
    shared = on, airtime_ns = overhead_ns;
    pthread_mutex_unlock(&cell_lock);
    return 0;
}

int serial_spin(int64_t ns) {
    if (ns < 0) return -EINVAL;
    spin_ns = ns;
    return 0;
}

int serial_pair(int source, int target, double rate_bit_s) {
    if (source < 0 || source >= port_count || target < 0 || target >= port_count) return -EINVAL;
    if (rate_bit_s < 0) return -EINVAL;
    pair_bit_s[source][target] = rate_bit_s;
    if (rate_bit_s > 0) pairs_set = 1;
    return 0;
}

/* The impairments of port `index`'s uplink, of its downlink (what its device receives) or of
 * the pair index -> target from the next frame on, taking ownership of `m` (NULL: none). */
int serial_impair(int index, struct impairments *m) {
    if (index < 0 || index >= port_count) return -EINVAL;
    pthread_mutex_lock(&ports[index].up_lock);
    struct impairments *old = ports[index].up;
    ports[index].up = m;
    pthread_mutex_unlock(&ports[index].up_lock);
    serial_impairments_free(old);
    return 0;
}

int serial_impair_down(int index, struct impairments *m) {
    if (index < 0 || index >= port_count) return -EINVAL;
    pthread_mutex_lock(&hop_lock);
    struct impairments *old = ports[index].down;
    ports[index].down = m;
    pthread_mutex_unlock(&hop_lock);
    serial_impairments_free(old);
    return 0;
}

int serial_impair_pair(int source, int target, struct impairments *m) {
    if (source < 0 || source >= port_count || target < 0 || target >= port_count) return -EINVAL;
    pthread_mutex_lock(&hop_lock);
    struct impairments *old = pair_hops[source][target];
    pair_hops[source][target] = m;
    pthread_mutex_unlock(&hop_lock);
    serial_impairments_free(old);
    return 0;
}

/* Whether the port reads frames as they come (one may overtake another), whether its frames
 * may meet later hops, and how many copies it holds at most while it reads ahead: the
 * program decides (port.py's reads_ahead, hops and queue_limit). */
int serial_mode(int index, int reads_ahead, int hops, int queue_limit) {
    if (index < 0 || index >= port_count || queue_limit < 1) return -EINVAL;
    ports[index].reads_ahead = reads_ahead;
    ports[index].hops = hops;
    ports[index].queue_limit = queue_limit;
    return 0;
}

/* A copy of the port's impairment events (the newest `room` at most, oldest first). */
int serial_events(int index, int64_t *times, int *codes, int room) {
    if (index < 0 || index >= port_count) return -EINVAL;
    struct port *port = &ports[index];
    pthread_mutex_lock(&port->lock);
    uint64_t logged = port->counters.event_logged;
    uint64_t kept = logged < EVENT_LOG ? logged : EVENT_LOG;
    if ((uint64_t)room < kept) kept = (uint64_t)room;
    for (uint64_t k = 0; k < kept; k++) {
        uint64_t slot = (logged - kept + k) % EVENT_LOG;
        times[k] = port->event_ns[slot];
        codes[k] = port->event_code[slot];
    }
    pthread_mutex_unlock(&port->lock);
    return (int)kept;
}

/* A copy of the port's counters and of its stall ring (the newest `room` at most, oldest
 * first); returns how many stalls it copied. */
int serial_counters(int index, struct counters *out, int64_t *starts, int64_t *lengths, int room) {
    if (index < 0 || index >= port_count) return -EINVAL;
    struct port *port = &ports[index];
    pthread_mutex_lock(&port->lock);
    *out = port->counters;
    uint64_t logged = port->counters.stall_logged;
    uint64_t kept = logged < STALL_LOG ? logged : STALL_LOG;
    if ((uint64_t)room < kept) kept = (uint64_t)room;
    for (uint64_t k = 0; k < kept; k++) {
        uint64_t slot = (logged - kept + k) % STALL_LOG;
        starts[k] = port->stall_start_ns[slot];
        lengths[k] = port->stall_ns[slot];
    }
    pthread_mutex_unlock(&port->lock);
    return (int)kept;
}

static int lookup(const unsigned char *mac) { /* under mac_lock */
    for (int i = 0; i < mac_count; i++)
        if (memcmp(macs[i], mac, 6) == 0) return i;
    return -1;
}

/* The port a unicast destination was learned on, or -1 (broadcast, multicast, unknown). */
static int egress_of(const unsigned char *frame) {
    if (frame[0] & 1) return -1;
    pthread_mutex_lock(&mac_lock);
    int found = lookup(frame);
    int port = found < 0 ? -1 : mac_port[found];
    pthread_mutex_unlock(&mac_lock);
    return port;
}

static void learn(const unsigned char *source, int index) {
    pthread_mutex_lock(&mac_lock);
    int found = lookup(source);
    if (found >= 0) {
        mac_port[found] = index;
    } else if (mac_count < MAX_MACS) {
        memcpy(macs[mac_count], source, 6);
        mac_port[mac_count++] = index;
    }
    pthread_mutex_unlock(&mac_lock);
}

static double frame_rate(int index, int egress) {
    double rate = ports[index].rate_bit_s;
    if (egress < 0) return rate;
    double down = ports[egress].down_bit_s, pair = pairs_set ? pair_bit_s[index][egress] : 0;
    if (down > 0 && down < rate) rate = down;
    if (pair > 0 && pair < rate) rate = pair;
    return rate;
}

/* The slot of a frame ready at `ready` whose wire time is `wire` on the port's own line, or
 * on the cell's where the medium is shared: sets *start and returns the slot's end, which
 * is the line's (or the cell's) next free moment. */
static int64_t take_line(struct port *port, int64_t ready, int64_t wire, int64_t *start) {
    if (!shared) {
        *start = ready > port->free_at_ns ? ready : port->free_at_ns;
        return port->free_at_ns = *start + wire;
    }
    pthread_mutex_lock(&cell_lock);
    *start = ready > cell_free_at_ns ? ready : cell_free_at_ns;
    cell_free_at_ns = *start + airtime_ns + wire;
    port->free_at_ns = cell_free_at_ns;
    pthread_mutex_unlock(&cell_lock);
    return port->free_at_ns;
}

static void transmit(struct port *port, const unsigned char *frame, ssize_t size) {
    if (send(port->fd, frame, (size_t)size, 0) < 0) {
        pthread_mutex_lock(&port->lock);
        port->counters.send_errors++;
        pthread_mutex_unlock(&port->lock);
    }
}

static void forward(int index, const unsigned char *frame, ssize_t size) {
    learn(frame + 6, index);
    int egress = egress_of(frame);
    if (egress == index) return;
    if (egress >= 0) {
        transmit(&ports[egress], frame, size);
        return;
    }
    for (int i = 0; i < port_count; i++)
        if (i != index && ports[i].fd >= 0) transmit(&ports[i], frame, size);
}

/* Whether a frame's departure is the moment a message arrives, so that its wait ends polling:
 * an IPv4 TCP segment that carries payload and PSH (the last segment of the sender's write),
 * or any frame other than TCP that found its line free (`free`). A bare ACK moves no
 * message's latency, and a segment inside a write is followed by the next one on the line,
 * whose schedule does not depend on when this one left. */
static int ends_message(const unsigned char *frame, ssize_t size, int free) {
    if (size < 34 || frame[12] != 0x08 || frame[13] != 0x00) return free;
    const unsigned char *ip = frame + 14;
    int header = (ip[0] & 15) * 4, total = ip[2] << 8 | ip[3];
    if ((ip[0] >> 4) != 4 || ip[9] != 6) return free;
    if (size < 14 + header + 20) return 0;
    const unsigned char *tcp = ip + header;
    return total > header + (tcp[12] >> 4) * 4 && (tcp[13] & 0x08);
}

int serial_ends_message(const unsigned char *frame, ssize_t size, int free) {
    return ends_message(frame, size, free);
}

static int64_t arrival_ns(struct msghdr *message, struct port *port) {
    int64_t now = now_ns();
    for (struct cmsghdr *c = CMSG_FIRSTHDR(message); c; c = CMSG_NXTHDR(message, c)) {
        if (c->cmsg_level != SOL_SOCKET) continue;
        if (c->cmsg_type != SO_TIMESTAMPNS_OLD && c->cmsg_type != SO_TIMESTAMPNS_NEW) continue;
        int64_t stamp[2];  /* both layouts are two 64-bit words on 64-bit kernels */
        memcpy(stamp, CMSG_DATA(c), sizeof stamp);
        int64_t at = stamp[0] * 1000000000LL + stamp[1];
        if (at - now < SANITY_NS && now - at < SANITY_NS) return at;
    }
    port->counters.clock_fallbacks++;
    return now;
}

static void record(struct port *port, ssize_t size, int64_t queued, int64_t late, int64_t due) {
    struct counters *c = &port->counters;
    pthread_mutex_lock(&port->lock);
    c->frames++;
    c->bytes += (uint64_t)size;
    c->queued_ns_sum += queued;
    if (queued > c->queued_ns_max) c->queued_ns_max = queued;
    c->late_ns_sum += late;
    if (late > c->late_ns_max) c->late_ns_max = late;
    if (late > STALL_NS && !port->stalling) {
        uint64_t slot = c->stall_logged % STALL_LOG;
        port->stall_start_ns[slot] = due;
        port->stall_ns[slot] = late;
        c->stall_logged++;
        c->stalls++;
        c->stalled_ns += late;
    }
    port->stalling = late > STALL_NS;
    pthread_mutex_unlock(&port->lock);
}

static void event(struct port *port, int64_t at, int code) {
    struct counters *c = &port->counters;
    pthread_mutex_lock(&port->lock);
    uint64_t slot = c->event_logged % EVENT_LOG;
    port->event_ns[slot] = at;
    port->event_code[slot] = (unsigned char)code;
    c->event_logged++;
    if (code == LOST) c->lost++;
    if (code == DUPLICATED) c->duplicated++;
    if (code == REORDERED) c->reordered++;
    pthread_mutex_unlock(&port->lock);
}

static void counted(struct port *port, int64_t at, int copies) {
    if (copies != 1) event(port, at, copies ? DUPLICATED : LOST);
}

static int before(const struct pending *a, const struct pending *b) {
    return a->due < b->due || (a->due == b->due && a->order < b->order);
}

static int push(struct port *port, int64_t due, int64_t queued, const unsigned char *frame, int size) {
    if (port->pending_count == port->pending_room) {
        int room = port->pending_room ? 2 * port->pending_room : 64;
        struct pending *grown = realloc(port->pending, sizeof *grown * (size_t)room);
        if (grown == NULL) return -ENOMEM;
        port->pending = grown, port->pending_room = room;
    }
    struct pending entry = {due, queued, port->order++, malloc((size_t)size), size};
    if (entry.frame == NULL) return -ENOMEM;
    memcpy(entry.frame, frame, (size_t)size);
    int at = port->pending_count++;
    while (at > 0 && before(&entry, &port->pending[(at - 1) / 2])) {
        port->pending[at] = port->pending[(at - 1) / 2];
        at = (at - 1) / 2;
    }
    port->pending[at] = entry;
    return 0;
}

static struct pending pop(struct port *port) {
    struct pending head = port->pending[0], last = port->pending[--port->pending_count];
    int at = 0, n = port->pending_count;
    for (;;) {
        int child = 2 * at + 1;
        if (child >= n) break;
        if (child + 1 < n && before(&port->pending[child + 1], &port->pending[child])) child++;
        if (!before(&port->pending[child], &last)) break;
        port->pending[at] = port->pending[child];
        at = child;
    }
    if (n) port->pending[at] = last;
    return head;
}

/* What one copy meets after the line (port.py's _hop_delays): the delay of each copy the
 * later hops send of it, the pair's then the receiver's downlink's; returns how many. */
static int hop_delays(int index, int egress, int64_t arrival, int64_t delays[MAX_FAN]) {
    struct port *port = &ports[index];
    int count = 1;
    int64_t next[MAX_FAN];
    struct copy drawn[2][MAX_FAN][2];
    int drawn_count[2][MAX_FAN];
    delays[0] = 0;
    pthread_mutex_lock(&hop_lock);  /* a downlink's generator is every sender's */
    struct impairments *hops[2] = {pair_hops[index][egress], ports[egress].down};
    int used[2] = {0, 0};
    for (int h = 0; h < 2; h++) {
        if (hops[h] == NULL) continue;
        int made = 0;
        for (int d = 0; d < count; d++) {
            drawn_count[h][d] = impair_frame(hops[h], drawn[h][d]);
            for (int c = 0; c < drawn_count[h][d] && made < MAX_FAN; c++)
                next[made++] = delays[d] + drawn[h][d][c].delay_ns; /* a reordered copy's is 0 */
        }
        used[h] = count;
        memcpy(delays, next, sizeof next);
        count = made;
    }
    pthread_mutex_unlock(&hop_lock);
    for (int h = 0; h < 2; h++)  /* counted outside the hops' lock, in the order drawn */
        for (int d = 0; d < used[h]; d++) {
            counted(port, arrival, drawn_count[h][d]);
            for (int c = 0; c < drawn_count[h][d]; c++)
                if (drawn[h][d][c].reordered) event(port, arrival, REORDERED);
        }
    return count;
}

/* A frame read (`size` bytes, its ancillary data in `message`), scheduled as port.py's
 * Port._read does: each copy it is sent as gets its time in the heap, by the rules in force
 * now. Returns 0, or -ENOMEM. */
static int schedule_impaired(int index, unsigned char *frame, ssize_t size, struct msghdr *message) {
    struct port *port = &ports[index];
    int64_t arrival = arrival_ns(message, port);
    int egress = egress_of(frame);
    double rate = frame_rate(index, egress);
    struct copy copies[2] = {{0, 0}, {0, 0}};
    int count = 1;
    pthread_mutex_lock(&port->up_lock);
    if (port->up != NULL) count = impair_frame(port->up, copies);
    pthread_mutex_unlock(&port->up_lock);
    counted(port, arrival, count);
    if (port->pending_count + count > port->queue_limit) {  /* reading ahead: this queue is ours */
        pthread_mutex_lock(&port->lock);
        port->counters.queue_drops += (uint64_t)count;
        pthread_mutex_unlock(&port->lock);
        return 0;
    }
    int64_t wire = (int64_t)((double)size * 8e9 / rate), air_start = 0, air_end = 0;
    if (shared) air_end = take_line(port, arrival, wire, &air_start); /* even if lost */
    for (int c = 0; c < count; c++) {
        int64_t send, queued = 0;
        if (shared) {  /* the air first, then the delay; a reordered copy skips it */
            queued = air_start - arrival;
            if (copies[c].reordered) {
                event(port, arrival, REORDERED);
                send = air_end;
            } else {  /* jitter does not reorder, as on a port's line */
                send = air_end + copies[c].delay_ns;
                if (send < port->sent_after_ns) send = port->sent_after_ns;
                port->sent_after_ns = send;
            }
        } else if (copies[c].reordered) {  /* a path of its own: no delay, the line untouched */
            event(port, arrival, REORDERED);
            send = arrival + wire;
        } else {
            int64_t start;
            send = take_line(port, arrival + copies[c].delay_ns, wire, &start);
            queued = start - (arrival + copies[c].delay_ns);
        }
        int64_t after[MAX_FAN] = {0};
        int fan = port->hops && egress >= 0 ? hop_delays(index, egress, arrival, after) : 1;
        for (int f = 0; f < fan; f++)
            if (push(port, send + after[f], queued, frame, (int)size) < 0) return -ENOMEM;
    }
    return 0;
}

/* One frame from the socket, scheduled (schedule_impaired). Returns 0, or -errno where the
 * socket or memory fails. */
static int read_impaired(int index, unsigned char *frame, struct msghdr *message) {
    struct port *port = &ports[index];
    ssize_t size = recvmsg(port->fd, message, 0);
    if (size < 0) return errno == EINTR ? 0 : -errno;
    struct sockaddr_ll *from = message->msg_name;
    if (from->sll_pkttype == PACKET_OUTGOING || size < 14) return 0;
    return schedule_impaired(index, frame, size, message);
}

/* Sleeps until `end` (CLOCK_REALTIME ns), polling its last spin_ns where `poll`. */
static void wait_until(int64_t end, int poll) {
    int64_t wake = poll ? end - spin_ns : end;
    struct timespec due = {wake / 1000000000LL, wake % 1000000000LL};
    if (wake > now_ns())
        while (clock_nanosleep(CLOCK_REALTIME, TIMER_ABSTIME, &due, NULL) == EINTR) {
        }
    while (poll && now_ns() < end) {
    }
}

/* Sends the heap's head once due, or reads the next frame where the port reads ahead and
 * one comes first (and `may_read`). Returns 0, or -errno. */
static int serve_pending(int index, unsigned char *frame, struct msghdr *message, int may_read) {
    struct port *port = &ports[index];
    struct pending *head = &port->pending[0];
    int poll = spin_ns && ends_message(head->frame, head->size, head->queued == 0);
    if (port->reads_ahead && may_read) {  /* reads what comes until the poll begins */
        int64_t wait = head->due - (poll ? spin_ns : 0) - now_ns();
        if (wait > 0) {
            struct pollfd readable = {port->fd, POLLIN, 0};
            struct timespec timeout = {wait / 1000000000LL, wait % 1000000000LL};
            int ready = ppoll(&readable, 1, &timeout, NULL);
            if (ready < 0) return errno == EINTR ? 0 : -errno;
            if (ready > 0) return read_impaired(index, frame, message);
        }
    }
    wait_until(head->due, poll);
    struct pending sent = pop(port);
    int64_t late = now_ns() - sent.due;
    forward(index, sent.frame, sent.size);
    record(port, sent.size, sent.queued, late, sent.due);
    free(sent.frame);
    return 0;
}

/* Serves port `index` until its socket fails; returns -errno. */
int serial_serve(int index) {
    if (index < 0 || index >= port_count || ports[index].fd < 0) return -EINVAL;
    struct port *port = &ports[index];
    static __thread unsigned char frame[FRAME_BUFFER];
    char control[256];
    for (;;) {
        struct sockaddr_ll from = {0};
        struct iovec vector = {frame, sizeof frame};
        struct msghdr message = {
            .msg_name = &from, .msg_namelen = sizeof from, .msg_iov = &vector,
            .msg_iovlen = 1, .msg_control = control, .msg_controllen = sizeof control,
        };
        if (port->pending_count || port->up != NULL || port->hops) {  /* impaired */
            int64_t air_end = port->free_at_ns;
            if (shared && air_end > now_ns()) {  /* its slot on the cell first: no reading */
                if (port->pending_count && port->pending[0].due < air_end) {
                    int failed = serve_pending(index, frame, &message, 0);
                    if (failed < 0) return failed;
                } else {
                    wait_until(air_end, 0);
                }
                continue;
            }
            int failed = port->pending_count ? serve_pending(index, frame, &message, 1)
                                             : read_impaired(index, frame, &message);
            if (failed < 0) return failed;
            continue;
        }
        ssize_t size = recvmsg(port->fd, &message, 0);
        if (size < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (from.sll_pkttype == PACKET_OUTGOING || size < 14) continue;
        /* impairments given while this thread waited for the frame are its rules already */
        if (__atomic_load_n(&port->up, __ATOMIC_ACQUIRE) != NULL || port->hops) {
            int failed = schedule_impaired(index, frame, size, &message);
            if (failed < 0) return failed;
            continue;
        }
        int64_t arrival = arrival_ns(&message, port);
        double rate = frame_rate(index, egress_of(frame));
        int64_t start, end = take_line(port, arrival, (int64_t)((double)size * 8e9 / rate), &start);
        wait_until(end, spin_ns && ends_message(frame, size, start == arrival));
        int64_t late = now_ns() - end;
        forward(index, frame, size);
        record(port, size, start - arrival, late, end);
    }
}
