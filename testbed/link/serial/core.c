/* The serial link's per-frame core (testbed.link.serial.core builds it, the program calls it).
 *
 * One thread per port runs serial_serve(port): read a frame with its kernel receive
 * timestamp, schedule it on the port's line (start = max(arrival, the previous frame's
 * scheduled end), end = start + wire time at the least of the sender's uplink, the receiver's
 * downlink and the pair's rate), sleep until the end, forward it, count it: the schedule and
 * the counters of the Python loop in program.py, without the interpreter on the frame's path
 * and without its lock between ports. The Python program opens the sockets, sets the rates
 * and reads the counters; impairments stay in Python (this core draws none). With
 * serial_spin(ns), a data frame that found its line free sleeps until `ns` before its end
 * and polls the clock from there (program.py, "Waiting").
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/if_packet.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define MAX_PORTS 64
#define MAX_MACS 1024
#define STALL_LOG 10000
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
};

struct port {
    int fd;
    volatile double rate_bit_s, down_bit_s; /* down 0: unshaped */
    int64_t free_at_ns;
    int stalling;
    struct counters counters;
    int64_t stall_start_ns[STALL_LOG], stall_ns[STALL_LOG]; /* a ring */
    pthread_mutex_t lock;      /* the counters and the stall ring, against a reader */
};

static struct port ports[MAX_PORTS];
static int port_count;
static volatile double pair_bit_s[MAX_PORTS][MAX_PORTS]; /* 0: none */
static volatile int pairs_set;
static volatile int64_t spin_ns;  /* a data frame that found the line free polls its last spin_ns */
static unsigned char macs[MAX_MACS][6];
static int mac_port[MAX_MACS];
static int mac_count;
static pthread_mutex_t mac_lock = PTHREAD_MUTEX_INITIALIZER;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

size_t serial_counters_size(void) { return sizeof(struct counters); }

int serial_init(int count) {
    if (count < 1 || count > MAX_PORTS) return -EINVAL;
    port_count = count;
    for (int i = 0; i < count; i++) {
        memset(&ports[i], 0, sizeof ports[i]);
        ports[i].fd = -1;
        pthread_mutex_init(&ports[i].lock, NULL);
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

/* Whether a frame is an IPv4 TCP segment without payload (an ACK): its time moves no
 * message's latency, so it never polls. */
static int bare_ack(const unsigned char *frame, ssize_t size) {
    if (size < 54 || frame[12] != 0x08 || frame[13] != 0x00) return 0;
    const unsigned char *ip = frame + 14;
    int header = (ip[0] & 15) * 4, total = ip[2] << 8 | ip[3];
    if ((ip[0] >> 4) != 4 || ip[9] != 6 || size < 14 + header + 20) return 0;
    return total == header + (ip[header + 12] >> 4) * 4;
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
        ssize_t size = recvmsg(port->fd, &message, 0);
        if (size < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (from.sll_pkttype == PACKET_OUTGOING || size < 14) continue;
        int64_t arrival = arrival_ns(&message, port);
        double rate = frame_rate(index, egress_of(frame));
        int64_t start = arrival > port->free_at_ns ? arrival : port->free_at_ns;
        int64_t end = start + (int64_t)((double)size * 8e9 / rate);
        port->free_at_ns = end;
        int poll = start == arrival && spin_ns && !bare_ack(frame, size);
        int64_t wake = poll ? end - spin_ns : end;
        struct timespec due = {wake / 1000000000LL, wake % 1000000000LL};
        if (wake > now_ns())
            while (clock_nanosleep(CLOCK_REALTIME, TIMER_ABSTIME, &due, NULL) == EINTR) {
            }
        while (poll && now_ns() < end) {
        }
        int64_t late = now_ns() - end;
        forward(index, frame, size);
        record(port, size, start - arrival, late, end);
    }
}
