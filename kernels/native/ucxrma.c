/*
 * _ucxrma: one-sided UCX (libucp) transport for pdserve's KV pulls.
 *
 * One UCP context + one worker (UCS_THREAD_MODE_MULTI) per Engine, progressed by a native pthread
 * that sleeps on the worker's event fd (ucp_worker_arm + poll) when idle.  Python never runs on
 * that thread: UCX callbacks only touch plain C state guarded by Engine.lock, and signal
 * Engine.cond.
 *
 * Objects and lifetimes
 *   Engine  owns context, worker, memory handles, the progress thread, the incoming-request queue
 *           and the list of pending transfers.  All C state lives inside the Python object, so
 *           anything holding a strong reference to the Engine may use its lock after close().
 *   Peer    (Python object) owns a refcounted peer_t: the ep and its unpacked rkeys.  The ep error
 *           callback's argument is the peer_t, which is freed only after the ep is closed.
 *   Xfer    (Python object) owns a reference to a refcounted xfer_t; UCX callbacks hold another.
 *
 * Locking: never call into UCX while holding Engine.lock (callbacks take it).  peer_t.oplock
 * serialises every use of the ep against closing it; order is oplock -> Engine.lock.
 *
 * Same-host path ("pvm")
 *   Engine.locality advertises (boot id, pid-namespace, pid, address of a 16-byte random nonce
 *   inside the Engine, the nonce).  connect(address, locality) on the same host and pid namespace
 *   probes the peer with process_vm_readv(2) of that nonce: if it reads back the same bytes the
 *   peer's gets bypass UCX and run as process_vm_readv iovec batches on native "pvm" worker
 *   threads (Engine.pvm_*); otherwise (EPERM, ENOSYS, ESRCH, mismatch) the peer stays on UCX and
 *   Peer.path_reason says why.  After the last batch of a get the nonce is read again, so a get
 *   only succeeds if every byte came from the same live peer engine (not from a process that
 *   reused its pid after it died, nor after it closed its engine: close() wipes the nonce).
 *   Jobs are split into batches of at most IOV_MAX segments / pvm_chunk bytes; a peer counts its
 *   in-flight batches (peer_t.pvm_inflight, under Engine.lock) and peer_close() cancels queued
 *   batches and waits for in-flight ones, so after abort() no byte can still land.
 *   The exporting engine calls prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY) so that Yama
 *   (ptrace_scope=1) lets same-uid non-ancestor processes read it.  PDSERVE_KV_SAME_HOST=0 turns
 *   all of this off (no prctl, empty locality, connect() ignores localities).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ucp/api/ucp.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#ifndef PR_SET_PTRACER
#define PR_SET_PTRACER 0x59616d61
#endif
#ifndef PR_SET_PTRACER_ANY
#define PR_SET_PTRACER_ANY ((unsigned long)-1)
#endif
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif
#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

#define AM_ID_REQUEST 0x5044 /* 'PD' */
#define AM_ID_REPLY   0x5045

enum { XS_PENDING = 0, XS_DONE = 1, XS_ERROR = 2 };
enum { XK_GET = 0, XK_REQUEST = 1, XK_CLOSE = 2 };
enum { PATH_UCX = 0, PATH_PVM = 1 };

#define NONCE_LEN 16
#define LOC_MAGIC "PDSLOC1"

/* Engine.locality wire format (host byte order: it is only ever compared on one host). */
typedef struct {
    char magic[8];
    char boot_id[40];          /* /proc/sys/kernel/random/boot_id, NUL-padded */
    uint64_t pidns_dev, pidns_ino;
    int64_t pid;
    uint64_t nonce_addr;
    uint8_t nonce[NONCE_LEN];
} locality_t;

typedef struct {
    uint64_t local, remote, len;
} pvm_op_t;

typedef struct EngineObject EngineObject;
typedef struct peer peer_t;

typedef struct xfer {
    EngineObject *eng;         /* borrowed: every holder also keeps the Engine alive */
    int refs;                  /* guarded by eng->lock */
    int state;
    int kind;
    ucs_status_t status;
    char err[160];
    uint64_t req_id;
    peer_t *peer;              /* NULL once the peer is gone */
    char *reply;
    size_t reply_len;
    struct xfer *prev, *next;  /* pending list (eng->pending) while state == XS_PENDING */
    int path;                  /* gets: PATH_UCX or PATH_PVM */
    /* pvm job (all guarded by eng->lock) */
    pvm_op_t *pops;
    size_t pn, pcur;           /* ops, next op to claim */
    uint64_t pcur_off;         /* bytes of ops[pcur] already claimed */
    int pclaimed_all;          /* nothing left to claim (done, failed or cancelled) */
    int pinflight;             /* batches being read now */
    int perr;                  /* first errno (ESTALE: peer identity changed) */
    int pfinal;                /* completion decided (exactly once) */
    peer_t *ppeer;             /* set while queued or in flight */
    struct xfer *pqnext;       /* eng->pvm_head queue */
} xfer_t;

struct peer {
    EngineObject *eng;
    int refs;                  /* guarded by eng->lock: Peer object + engine list */
    pthread_mutex_t oplock;
    ucp_ep_h ep;
    int ep_closed;             /* guarded by oplock */
    int failed;                /* set by the error callback (eng->lock) */
    ucs_status_t fail_status;
    ucp_rkey_h *rkeys;
    uint64_t *rk_base, *rk_len;  /* remote region bounds per rkey (len 0: unknown) */
    size_t nrkeys, caprkeys;
    peer_t *prev, *next;       /* eng->peers */
    int path;                  /* PATH_UCX or PATH_PVM (fixed at connect) */
    char path_reason[160];     /* why not pvm ("" when pvm) */
    pid_t pid;                 /* pvm: the peer process */
    uint64_t nonce_addr;
    uint8_t nonce[NONCE_LEN];
    int pvm_inflight;          /* pvm batches of this peer being read (eng->lock) */
};

typedef struct inreq {
    struct inreq *next;
    ucp_ep_h reply_ep;         /* UCX's endpoint back to the requester */
    uint64_t req_id;
    size_t addr_len, payload_len;
    char data[];               /* sender address, then payload */
} inreq_t;

typedef struct {
    ucp_mem_h memh;
    uintptr_t addr;
    size_t length;
} region_t;

struct EngineObject {
    PyObject_HEAD
    ucp_context_h ctx;
    ucp_worker_h worker;
    int efd;
    int wakeup;                /* UCP_FEATURE_WAKEUP on: sleep on efd; off: sleep-backoff */
    pthread_t thread;
    int thread_started;
    volatile int stop;
    int closed;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int sync_ok;
    inreq_t *in_head, *in_tail;
    size_t in_count;
    xfer_t *pending;
    peer_t *peers;
    uint64_t next_req_id;
    region_t *regions;
    size_t nregions, capregions;
    char *address;
    size_t address_len;
    uint64_t dropped_am;
    uint64_t failed_replies;
    /* same-host path */
    volatile uint8_t nonce[NONCE_LEN]; /* read by peers through process_vm_readv */
    locality_t self_loc;
    int have_loc;              /* self_loc is valid and advertised */
    int loc_known;             /* boot id / pidns readable (to compare peers' localities) */
    pthread_cond_t pvm_cond;   /* workers wait here for jobs (with eng->lock) */
    xfer_t *pvm_head, *pvm_tail;
    pthread_t *pvm_threads;
    int pvm_nthreads, pvm_started, pvm_stop;
    size_t pvm_chunk;
};

typedef struct {
    PyObject_HEAD
    EngineObject *eng; /* strong */
    peer_t *p;
} PeerObject;

typedef struct {
    PyObject_HEAD
    EngineObject *eng; /* strong */
    xfer_t *x;
} XferObject;

/* Wire headers. */
typedef struct {
    uint64_t req_id;
    uint32_t addr_len;
    uint32_t reserved;
} req_hdr_t;

typedef struct {
    uint64_t req_id;
} rep_hdr_t;

typedef struct {
    EngineObject *eng;
    uint64_t req_id;  /* 0: a reply, nothing to fail on error */
    union {
        req_hdr_t req;
        rep_hdr_t rep;
    } hdr;
    size_t len;
    char data[];
} send_ctx_t;

static PyObject *TransportError;
static PyTypeObject EngineType, PeerType, XferType;

/* ------------------------------------------------------------------ helpers */

static void deadline_from_now(struct timespec *ts, double timeout_s)
{
    clock_gettime(CLOCK_MONOTONIC, ts);
    if (timeout_s < 0) timeout_s = 0;
    if (timeout_s > 1e7) timeout_s = 1e7;
    time_t sec = (time_t)timeout_s;
    long nsec = (long)((timeout_s - (double)sec) * 1e9);
    ts->tv_sec += sec;
    ts->tv_nsec += nsec;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec += 1;
        ts->tv_nsec -= 1000000000L;
    }
}

static PyObject *raise_status(const char *what, ucs_status_t st)
{
    PyErr_Format(TransportError, "%s: %s", what, ucs_status_string(st));
    return NULL;
}

/* All xfer_* helpers below expect eng->lock held unless stated. */

static xfer_t *xfer_new(EngineObject *e, int kind, peer_t *p, int refs)
{
    xfer_t *x = calloc(1, sizeof(*x));
    if (x == NULL) return NULL;
    x->eng = e;
    x->refs = refs;
    x->kind = kind;
    x->peer = p;
    x->state = XS_PENDING;
    x->status = UCS_INPROGRESS;
    x->next = e->pending;
    if (e->pending) e->pending->prev = x;
    e->pending = x;
    return x;
}

static void xfer_unlink(xfer_t *x)
{
    EngineObject *e = x->eng;
    if (x->prev) x->prev->next = x->next;
    else if (e->pending == x) e->pending = x->next;
    if (x->next) x->next->prev = x->prev;
    x->prev = x->next = NULL;
}

static void xfer_unref(xfer_t *x);

/* Move x out of XS_PENDING (eng->lock held).  A request's reply path owns one reference for as
 * long as the request is pending; it is dropped here, so x may be freed on return. */
static void xfer_finish(xfer_t *x, ucs_status_t st, const char *why)
{
    if (x->state != XS_PENDING) return;
    xfer_unlink(x);
    x->status = st;
    if (st == UCS_OK) {
        x->state = XS_DONE;
    } else {
        x->state = XS_ERROR;
        snprintf(x->err, sizeof(x->err), "%s: %s", why, ucs_status_string(st));
    }
    pthread_cond_broadcast(&x->eng->cond);
    if (x->kind == XK_REQUEST) xfer_unref(x);
}

/* Like xfer_finish for a failure, with a complete error text (eng->lock held). */
static void xfer_fail_msg(xfer_t *x, ucs_status_t st, const char *msg)
{
    if (x->state != XS_PENDING) return;
    xfer_finish(x, st, "");
    snprintf(x->err, sizeof(x->err), "%s", msg);
}

static void xfer_unref(xfer_t *x)
{
    if (--x->refs > 0) return;
    if (x->state == XS_PENDING) xfer_unlink(x);
    free(x->reply);
    free(x->pops);
    free(x);
}

static void xfer_unref_locked(xfer_t *x)
{
    EngineObject *e = x->eng;
    pthread_mutex_lock(&e->lock);
    xfer_unref(x);
    pthread_mutex_unlock(&e->lock);
}

/* Fail every pending transfer that belongs to p (eng->lock held). */
static void fail_peer_xfers(peer_t *p, ucs_status_t st, const char *why, int kinds_mask)
{
    xfer_t *x = p->eng->pending, *nx;
    for (; x != NULL; x = nx) {
        nx = x->next;
        if (x->peer == p && (kinds_mask & (1 << x->kind))) xfer_finish(x, st, why);
    }
}

/* ---------------------------------------------------------- UCX callbacks */

static void flush_cb(void *request, ucs_status_t status, void *user_data)
{
    xfer_t *x = user_data;
    EngineObject *e = x->eng;
    pthread_mutex_lock(&e->lock);
    xfer_finish(x, status, "get");
    xfer_unref(x);
    pthread_mutex_unlock(&e->lock);
    ucp_request_free(request);
}

static void close_cb(void *request, ucs_status_t status, void *user_data)
{
    xfer_t *x = user_data;
    EngineObject *e = x->eng;
    pthread_mutex_lock(&e->lock);
    /* A forced close reports the reason the ep went down; closing itself succeeded. */
    (void)status;
    xfer_finish(x, UCS_OK, "close");
    xfer_unref(x);
    pthread_mutex_unlock(&e->lock);
    ucp_request_free(request);
}

static void am_send_cb(void *request, ucs_status_t status, void *user_data)
{
    send_ctx_t *c = user_data;
    EngineObject *e = c->eng;
    if (status != UCS_OK && c->req_id == 0) {
        pthread_mutex_lock(&e->lock);
        e->failed_replies++;
        pthread_mutex_unlock(&e->lock);
    }
    if (status != UCS_OK && c->req_id != 0) {
        pthread_mutex_lock(&e->lock);
        for (xfer_t *x = e->pending; x != NULL; x = x->next) {
            if (x->kind == XK_REQUEST && x->req_id == c->req_id) {
                xfer_finish(x, status, "request send");
                break;
            }
        }
        pthread_mutex_unlock(&e->lock);
    }
    free(c);
    ucp_request_free(request);
}

static void ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    peer_t *p = arg;
    EngineObject *e = p->eng;
    (void)ep;
    pthread_mutex_lock(&e->lock);
    p->failed = 1;
    p->fail_status = status;
    /* Requests wait for a reply UCX knows nothing about: fail them here. Gets fail through
     * their flush request, which UCX completes with an error. */
    xfer_t *x = e->pending, *nx;
    for (; x != NULL; x = nx) {
        nx = x->next;
        if (x->peer == p && x->kind == XK_REQUEST) {
            xfer_finish(x, status, "peer failed");
        }
    }
    pthread_cond_broadcast(&e->cond);
    pthread_mutex_unlock(&e->lock);
}

static ucs_status_t am_request_cb(void *arg, const void *header, size_t header_length, void *data,
                                  size_t length, const ucp_am_recv_param_t *param)
{
    EngineObject *e = arg;
    req_hdr_t h;
    if (header_length != sizeof(h) || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        pthread_mutex_lock(&e->lock);
        e->dropped_am++;
        pthread_mutex_unlock(&e->lock);
        return UCS_OK;
    }
    memcpy(&h, header, sizeof(h));
    if (h.addr_len > length) {
        pthread_mutex_lock(&e->lock);
        e->dropped_am++;
        pthread_mutex_unlock(&e->lock);
        return UCS_OK;
    }
    inreq_t *r = malloc(sizeof(*r) + length);
    if (r == NULL) return UCS_OK;
    r->next = NULL;
    r->reply_ep = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : NULL;
    r->req_id = h.req_id;
    r->addr_len = h.addr_len;
    r->payload_len = length - h.addr_len;
    if (length) memcpy(r->data, data, length);
    pthread_mutex_lock(&e->lock);
    if (e->in_tail) e->in_tail->next = r;
    else e->in_head = r;
    e->in_tail = r;
    e->in_count++;
    pthread_cond_broadcast(&e->cond);
    pthread_mutex_unlock(&e->lock);
    return UCS_OK;
}

static ucs_status_t am_reply_cb(void *arg, const void *header, size_t header_length, void *data,
                                size_t length, const ucp_am_recv_param_t *param)
{
    EngineObject *e = arg;
    rep_hdr_t h;
    if (header_length != sizeof(h) || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        pthread_mutex_lock(&e->lock);
        e->dropped_am++;
        pthread_mutex_unlock(&e->lock);
        return UCS_OK;
    }
    memcpy(&h, header, sizeof(h));
    char *copy = malloc(length ? length : 1);
    if (copy != NULL && length) memcpy(copy, data, length);
    pthread_mutex_lock(&e->lock);
    xfer_t *x = e->pending;
    for (; x != NULL; x = x->next)
        if (x->kind == XK_REQUEST && x->req_id == h.req_id) break;
    if (x != NULL && copy != NULL) {
        x->reply = copy;
        x->reply_len = length;
        copy = NULL;
        xfer_finish(x, UCS_OK, "reply");
    } else if (x == NULL) {
        e->dropped_am++; /* late reply: the request was aborted or timed out */
    } else {
        xfer_finish(x, UCS_ERR_NO_MEMORY, "reply");
    }
    pthread_mutex_unlock(&e->lock);
    free(copy);
    return UCS_OK;
}

/* ------------------------------------------------------- progress thread */

static void wake(EngineObject *e)
{
    if (e->wakeup) ucp_worker_signal(e->worker);
}


static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

/* Keep polling this long after the last event before sleeping: a busy transfer (notably
 * software-emulated RMA over tcp, where the target must serve every GET) is not slowed down by
 * a wake-up per message, while an idle worker still costs no CPU.  PDSERVE_UCX_SPIN_US. */
static double spin_budget_us(void)
{
    const char *v = getenv("PDSERVE_UCX_SPIN_US");
    if (v == NULL || *v == '\0') return 200.0;
    double d = atof(v);
    return d < 0 ? 0 : d;
}

static void *progress_main(void *arg)
{
    EngineObject *e = arg;
    struct pollfd pfd = {.fd = e->efd, .events = POLLIN};
    const double spin_us = spin_budget_us();
    while (!e->stop) {
        double last = now_us();
        for (;;) {
            if (e->stop) break;
            if (ucp_worker_progress(e->worker)) {
                last = now_us();
                continue;
            }
            if (now_us() - last >= spin_us) break;
        }
        if (e->stop) break;
        if (!e->wakeup) {
            /* No event fd (UCP_FEATURE_WAKEUP off so that event-less transports such as cma
             * qualify for RMA lanes): back off up to 1 ms between idle polls. */
            long sleep_us = 20;
            while (!e->stop && !ucp_worker_progress(e->worker)) {
                struct timespec ts = {.tv_sec = 0, .tv_nsec = sleep_us * 1000};
                nanosleep(&ts, NULL);
                if (sleep_us < 1000) sleep_us *= 2;
            }
            continue;
        }
        ucs_status_t st = ucp_worker_arm(e->worker);
        if (st == UCS_ERR_BUSY) continue;
        /* The timeout only bounds how late keepalive and timers run on an idle worker. */
        (void)poll(&pfd, 1, st == UCS_OK ? 100 : 1);
    }
    return NULL;
}

/* Wait (GIL released by caller) until x leaves XS_PENDING or the deadline passes. */
static int wait_xfer(xfer_t *x, double timeout_s)
{
    EngineObject *e = x->eng;
    struct timespec ts;
    deadline_from_now(&ts, timeout_s);
    pthread_mutex_lock(&e->lock);
    while (x->state == XS_PENDING) {
        int rc = pthread_cond_timedwait(&e->cond, &e->lock, &ts);
        if (rc == ETIMEDOUT) break;
    }
    int state = x->state;
    pthread_mutex_unlock(&e->lock);
    return state;
}

/* ------------------------------------------------------------ pvm path */

/* Read the peer's nonce: 0 when it is the same live engine, else an errno (ESTALE: another
 * process now has that pid, or the peer closed its engine). */
static int pvm_check_nonce(pid_t pid, uint64_t addr, const uint8_t *nonce)
{
    uint8_t buf[NONCE_LEN];
    struct iovec l = {.iov_base = buf, .iov_len = sizeof(buf)};
    struct iovec r = {.iov_base = (void *)(uintptr_t)addr, .iov_len = sizeof(buf)};
    ssize_t got;
    do {
        got = process_vm_readv(pid, &l, 1, &r, 1, 0);
    } while (got < 0 && errno == EINTR);
    if (got < 0) return errno;
    if (got != (ssize_t)sizeof(buf)) return EFAULT;
    return memcmp(buf, nonce, sizeof(buf)) == 0 ? 0 : ESTALE;
}

/* Read every segment (paired iovecs of equal lengths), looping over short reads.  0 or errno. */
static int pvm_read_all(pid_t pid, struct iovec *l, struct iovec *r, size_t n)
{
    while (n > 0) {
        ssize_t got = process_vm_readv(pid, l, n, r, n, 0);
        if (got < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (got == 0) return EFAULT;
        size_t left = (size_t)got;
        while (n > 0 && left >= l->iov_len) {
            left -= l->iov_len;
            l++;
            r++;
            n--;
        }
        if (left) { /* stopped inside a segment: resume from there */
            l->iov_base = (char *)l->iov_base + left;
            l->iov_len -= left;
            r->iov_base = (char *)r->iov_base + left;
            r->iov_len -= left;
        }
    }
    return 0;
}

/* Remove x from the pvm queue and stop further claims (eng->lock held). */
static void pvm_stop_claims(xfer_t *x)
{
    EngineObject *e = x->eng;
    x->pclaimed_all = 1;
    xfer_t **pp = &e->pvm_head, *prev = NULL;
    for (; *pp != NULL; prev = *pp, pp = &(*pp)->pqnext) {
        if (*pp == x) {
            *pp = x->pqnext;
            if (e->pvm_tail == x) e->pvm_tail = prev;
            x->pqnext = NULL;
            return;
        }
    }
}

/* Claim the next batch of x into l/r (eng->lock held); returns the number of segments. */
static size_t pvm_claim(xfer_t *x, struct iovec *l, struct iovec *r)
{
    EngineObject *e = x->eng;
    size_t n = 0, bytes = 0;
    while (x->pcur < x->pn && n < IOV_MAX && bytes < e->pvm_chunk) {
        pvm_op_t *op = &x->pops[x->pcur];
        uint64_t len = op->len - x->pcur_off;
        if (len > e->pvm_chunk - bytes) len = e->pvm_chunk - bytes;
        l[n].iov_base = (void *)(uintptr_t)(op->local + x->pcur_off);
        r[n].iov_base = (void *)(uintptr_t)(op->remote + x->pcur_off);
        l[n].iov_len = r[n].iov_len = (size_t)len;
        n++;
        bytes += len;
        x->pcur_off += len;
        if (x->pcur_off == op->len) {
            x->pcur++;
            x->pcur_off = 0;
        }
    }
    if (x->pcur >= x->pn) pvm_stop_claims(x);
    return n;
}

/* Decide the outcome of a finished job (eng->lock held, p counted in flight).  err: 0 or errno. */
static void pvm_complete(xfer_t *x, peer_t *p, int err)
{
    char msg[sizeof(x->err)];
    if (err == 0) {
        xfer_finish(x, UCS_OK, "get");
    } else if (err == ECANCELED) {
        xfer_fail_msg(x, UCS_ERR_CANCELED, "get (pvm): aborted");
    } else if (err == ESRCH || err == ESTALE) {
        snprintf(msg, sizeof(msg), "get (pvm): peer process %d is gone%s", (int)p->pid,
                 err == ESTALE ? " (its engine closed or its pid was reused)" : "");
        if (!p->failed) {
            p->failed = 1;
            p->fail_status = UCS_ERR_CONNECTION_RESET;
        }
        xfer_fail_msg(x, UCS_ERR_CONNECTION_RESET, msg);
    } else {
        snprintf(msg, sizeof(msg), "get (pvm): process_vm_readv from pid %d: %s", (int)p->pid,
                 strerror(err));
        xfer_fail_msg(x, err == EFAULT ? UCS_ERR_INVALID_ADDR : UCS_ERR_IO_ERROR, msg);
    }
    x->ppeer = NULL;
    xfer_unref(x); /* the job's reference */
}

static void *pvm_main(void *arg)
{
    EngineObject *e = arg;
    struct iovec *l = malloc(2 * IOV_MAX * sizeof(struct iovec));
    pthread_mutex_lock(&e->lock);
    for (;;) {
        while (!e->pvm_stop && e->pvm_head == NULL) pthread_cond_wait(&e->pvm_cond, &e->lock);
        if (e->pvm_stop) break;
        xfer_t *x = e->pvm_head;
        peer_t *p = x->ppeer;
        if (l == NULL) { /* no memory for iovecs: fail the job rather than spin */
            pvm_stop_claims(x);
            if (!x->perr) x->perr = ENOMEM;
            if (x->pinflight == 0 && !x->pfinal) {
                x->pfinal = 1;
                pvm_complete(x, p, x->perr);
            }
            pthread_cond_broadcast(&e->cond);
            continue;
        }
        struct iovec *r = l + IOV_MAX;
        size_t n = pvm_claim(x, l, r);
        x->pinflight++;
        p->pvm_inflight++;
        pid_t pid = p->pid;
        pthread_mutex_unlock(&e->lock);
        int err = pvm_read_all(pid, l, r, n);
        pthread_mutex_lock(&e->lock);
        x->pinflight--;
        if (err && !x->perr) {
            x->perr = err;
            pvm_stop_claims(x);
        }
        if (x->pclaimed_all && x->pinflight == 0 && !x->pfinal) {
            x->pfinal = 1;
            err = x->perr;
            if (err == 0 && x->state == XS_PENDING) {
                /* Every byte was read; make sure they all came from the same live engine. */
                uint64_t addr = p->nonce_addr;
                uint8_t nonce[NONCE_LEN];
                memcpy(nonce, p->nonce, sizeof(nonce));
                pthread_mutex_unlock(&e->lock);
                err = pvm_check_nonce(pid, addr, nonce);
                pthread_mutex_lock(&e->lock);
            }
            pvm_complete(x, p, err); /* may free x */
        }
        p->pvm_inflight--;
        pthread_cond_broadcast(&e->cond);
    }
    pthread_mutex_unlock(&e->lock);
    free(l);
    return NULL;
}

/* Start the pvm workers once (GIL held, so never concurrently). */
static int pvm_start(EngineObject *e)
{
    if (e->pvm_started) return 0;
    /* Default: 2 workers when we may run on 2+ CPUs (measured: 13.6 -> 19.5 GB/s for 256 MiB
     * KV-shaped pulls on a 2-core VM; one batch pins remote pages one by one, two overlap). */
    int n = 1;
    cpu_set_t cs;
    if (sched_getaffinity(0, sizeof(cs), &cs) == 0 && CPU_COUNT(&cs) >= 2) n = 2;
    const char *v = getenv("PDSERVE_KV_PVM_THREADS");
    if (v != NULL && *v != '\0') n = atoi(v);
    if (n < 1) n = 1;
    if (n > 16) n = 16;
    size_t chunk = 4u << 20;
    v = getenv("PDSERVE_KV_PVM_CHUNK_KIB");
    if (v != NULL && *v != '\0' && atol(v) > 0) chunk = (size_t)atol(v) << 10;
    e->pvm_chunk = chunk;
    e->pvm_threads = calloc((size_t)n, sizeof(pthread_t));
    if (e->pvm_threads == NULL) return ENOMEM;
    for (int i = 0; i < n; i++) {
        int rc = pthread_create(&e->pvm_threads[i], NULL, pvm_main, e);
        if (rc != 0) {
            if (i == 0) {
                free(e->pvm_threads);
                e->pvm_threads = NULL;
                return rc;
            }
            break;
        }
        e->pvm_nthreads = i + 1;
    }
    e->pvm_started = 1;
    return 0;
}

/* Stop and join the workers (GIL released by caller).  Jobs still queued are cancelled. */
static void pvm_stop_all(EngineObject *e)
{
    if (!e->pvm_started) return;
    pthread_mutex_lock(&e->lock);
    e->pvm_stop = 1;
    pthread_cond_broadcast(&e->pvm_cond);
    pthread_mutex_unlock(&e->lock);
    for (int i = 0; i < e->pvm_nthreads; i++) pthread_join(e->pvm_threads[i], NULL);
    pthread_mutex_lock(&e->lock);
    while (e->pvm_head != NULL) {
        xfer_t *x = e->pvm_head;
        pvm_stop_claims(x);
        if (!x->pfinal) {
            x->pfinal = 1;
            pvm_complete(x, x->ppeer, ECANCELED);
        }
    }
    pthread_mutex_unlock(&e->lock);
    free(e->pvm_threads);
    e->pvm_threads = NULL;
    e->pvm_nthreads = 0;
    e->pvm_started = 0;
}

/* Cancel p's queued pvm batches and wait until none is in flight (GIL released by caller).
 * Returns 0, or -1 if a batch was still being read at the deadline. */
static int pvm_drain_peer(peer_t *p, double timeout_s)
{
    EngineObject *e = p->eng;
    struct timespec ts;
    deadline_from_now(&ts, timeout_s);
    pthread_mutex_lock(&e->lock);
    xfer_t *x = e->pvm_head, *nx;
    for (; x != NULL; x = nx) {
        nx = x->pqnext;
        if (x->ppeer != p) continue;
        if (!x->perr) x->perr = ECANCELED;
        pvm_stop_claims(x);
        if (x->pinflight == 0 && !x->pfinal) {
            x->pfinal = 1;
            pvm_complete(x, p, ECANCELED);
        }
    }
    int rc = 0;
    while (p->pvm_inflight > 0) {
        if (pthread_cond_timedwait(&e->cond, &e->lock, &ts) == ETIMEDOUT) {
            rc = p->pvm_inflight > 0 ? -1 : 0;
            break;
        }
    }
    pthread_mutex_unlock(&e->lock);
    return rc;
}

/* ------------------------------------------------------------- peer core */

static void peer_unref(peer_t *p)
{
    EngineObject *e = p->eng;
    pthread_mutex_lock(&e->lock);
    int left = --p->refs;
    pthread_mutex_unlock(&e->lock);
    if (left > 0) return;
    pthread_mutex_destroy(&p->oplock);
    free(p->rkeys);
    free(p->rk_base);
    free(p->rk_len);
    free(p);
}

/* Force-close the ep (GIL released by caller).  Returns 0 when the close completed, -1 when it
 * timed out (then the peer_t must be leaked, because UCX may still call its error callback). */
static int peer_close(peer_t *p, double timeout_s)
{
    EngineObject *e = p->eng;
    int rc = 0;
    pthread_mutex_lock(&p->oplock);
    if (!p->ep_closed) {
        p->ep_closed = 1;
        /* No new get can start (oplock, ep_closed); cancel and wait out same-host reads. */
        if (p->path == PATH_PVM && pvm_drain_peer(p, timeout_s) != 0) rc = -1;
        pthread_mutex_lock(&e->lock);
        xfer_t *cx = xfer_new(e, XK_CLOSE, p, 2);
        pthread_mutex_unlock(&e->lock);
        ucp_request_param_t prm = {
            .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                            UCP_OP_ATTR_FIELD_USER_DATA,
            .flags = UCP_EP_CLOSE_FLAG_FORCE,
            .cb.send = close_cb,
            .user_data = cx,
        };
        ucs_status_ptr_t r = ucp_ep_close_nbx(p->ep, &prm);
        if (!UCS_PTR_IS_PTR(r)) {
            pthread_mutex_lock(&e->lock);
            xfer_finish(cx, UCS_OK, "close");
            cx->refs--; /* no callback will come */
            pthread_mutex_unlock(&e->lock);
        } else {
            wake(e);
            if (wait_xfer(cx, timeout_s) == XS_PENDING) rc = -1;
        }
        pthread_mutex_lock(&e->lock);
        fail_peer_xfers(p, UCS_ERR_CANCELED, "aborted", (1 << XK_GET) | (1 << XK_REQUEST));
        if (rc == 0) xfer_finish(cx, UCS_OK, "close");
        xfer_unref(cx);
        pthread_mutex_unlock(&e->lock);
        if (rc == 0) {
            for (size_t i = 0; i < p->nrkeys; i++)
                if (p->rkeys[i]) ucp_rkey_destroy(p->rkeys[i]);
            p->nrkeys = 0;
        }
    }
    pthread_mutex_unlock(&p->oplock);
    return rc;
}

/* Remove p from the engine list and detach its transfers (eng->lock held). */
static void peer_detach_locked(peer_t *p)
{
    EngineObject *e = p->eng;
    if (p->prev) p->prev->next = p->next;
    else if (e->peers == p) e->peers = p->next;
    if (p->next) p->next->prev = p->prev;
    p->prev = p->next = NULL;
    for (xfer_t *x = e->pending; x != NULL; x = x->next)
        if (x->peer == p) x->peer = NULL;
}

/* --------------------------------------------------------------- Engine */

static int same_host_enabled(void)
{
    const char *v = getenv("PDSERVE_KV_SAME_HOST");
    return !(v != NULL && strcmp(v, "0") == 0);
}

/* Fill boot id and pid namespace of this process; 0 on success. */
static int read_host_identity(locality_t *loc)
{
    memset(loc, 0, sizeof(*loc));
    memcpy(loc->magic, LOC_MAGIC, sizeof(LOC_MAGIC));
    int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t got = read(fd, loc->boot_id, sizeof(loc->boot_id) - 1);
    close(fd);
    if (got < 16) return -1;
    for (ssize_t i = 0; i < got; i++)
        if (loc->boot_id[i] == '\n') loc->boot_id[i] = '\0';
    struct stat st;
    if (stat("/proc/self/ns/pid", &st) != 0) return -1;
    loc->pidns_dev = (uint64_t)st.st_dev;
    loc->pidns_ino = (uint64_t)st.st_ino;
    loc->pid = (int64_t)getpid();
    return 0;
}

static void fill_nonce(uint8_t *out)
{
    size_t off = 0;
    while (off < NONCE_LEN) {
        ssize_t got = getrandom(out + off, NONCE_LEN - off, 0);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) break;
        off += (size_t)got;
    }
    if (off < NONCE_LEN) { /* no getrandom: time, pid and address are unique enough per host */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint64_t mix[2] = {(uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec,
                           ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)out};
        memcpy(out, mix, NONCE_LEN);
    }
}

/* Set up the same-host identity (GIL held, at init). */
static void engine_init_locality(EngineObject *self)
{
    self->loc_known = read_host_identity(&self->self_loc) == 0;
    if (!self->loc_known || !same_host_enabled()) return;
    /* Yama ptrace_scope=1 only lets ancestors read us: allow any same-uid reader (the usual uid,
     * capability and dumpable checks of process_vm_readv still apply).  Without Yama this fails
     * with EINVAL, which is fine. */
    (void)prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
    uint8_t nonce[NONCE_LEN];
    fill_nonce(nonce);
    memcpy((void *)self->nonce, nonce, NONCE_LEN);
    self->self_loc.nonce_addr = (uint64_t)(uintptr_t)self->nonce;
    memcpy(self->self_loc.nonce, nonce, NONCE_LEN);
    self->have_loc = 1;
}

static int engine_init(EngineObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"name", NULL};
    const char *name = "pdserve";
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|s", kwlist, &name)) return -1;
    if (self->ctx != NULL) {
        PyErr_SetString(TransportError, "Engine already initialised");
        return -1;
    }

    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&self->lock, NULL);
    pthread_cond_init(&self->cond, &ca);
    pthread_condattr_destroy(&ca);
    pthread_cond_init(&self->pvm_cond, NULL);
    self->sync_ok = 1;
    self->efd = -1;
    self->next_req_id = 1;

    const char *wk = getenv("PDSERVE_UCX_WAKEUP");
    self->wakeup = !(wk != NULL && strcmp(wk, "0") == 0);
    ucp_config_t *cfg = NULL;
    ucs_status_t st = ucp_config_read(NULL, NULL, &cfg); /* honours UCX_* */
    if (st != UCS_OK) {
        raise_status("ucp_config_read", st);
        return -1;
    }
    ucp_params_t prm = {
        .field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME,
        .features = UCP_FEATURE_RMA | UCP_FEATURE_AM | (self->wakeup ? UCP_FEATURE_WAKEUP : 0),
        .name = name,
    };
    Py_BEGIN_ALLOW_THREADS
    st = ucp_init(&prm, cfg, &self->ctx);
    Py_END_ALLOW_THREADS
    ucp_config_release(cfg);
    if (st != UCS_OK) {
        self->ctx = NULL;
        raise_status("ucp_init", st);
        return -1;
    }

    ucp_worker_params_t wp = {
        .field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
        .thread_mode = UCS_THREAD_MODE_MULTI,
    };
    Py_BEGIN_ALLOW_THREADS
    st = ucp_worker_create(self->ctx, &wp, &self->worker);
    Py_END_ALLOW_THREADS
    if (st != UCS_OK) {
        self->worker = NULL;
        raise_status("ucp_worker_create", st);
        return -1;
    }

    ucp_worker_attr_t wa = {
        .field_mask = UCP_WORKER_ATTR_FIELD_THREAD_MODE | UCP_WORKER_ATTR_FIELD_ADDRESS,
    };
    st = ucp_worker_query(self->worker, &wa);
    if (st != UCS_OK) {
        raise_status("ucp_worker_query", st);
        return -1;
    }
    if (wa.thread_mode != UCS_THREAD_MODE_MULTI) {
        ucp_worker_release_address(self->worker, wa.address);
        PyErr_SetString(TransportError, "libucp was built without multi-thread support");
        return -1;
    }
    self->address = malloc(wa.address_length);
    if (self->address == NULL) {
        ucp_worker_release_address(self->worker, wa.address);
        PyErr_NoMemory();
        return -1;
    }
    memcpy(self->address, wa.address, wa.address_length);
    self->address_len = wa.address_length;
    ucp_worker_release_address(self->worker, wa.address);

    if (self->wakeup) {
        st = ucp_worker_get_efd(self->worker, &self->efd);
        if (st != UCS_OK) {
            raise_status("ucp_worker_get_efd", st);
            return -1;
        }
    }

    ucp_am_handler_param_t ah = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG,
        .id = AM_ID_REQUEST,
        .cb = am_request_cb,
        .arg = self,
    };
    st = ucp_worker_set_am_recv_handler(self->worker, &ah);
    if (st == UCS_OK) {
        ah.id = AM_ID_REPLY;
        ah.cb = am_reply_cb;
        st = ucp_worker_set_am_recv_handler(self->worker, &ah);
    }
    if (st != UCS_OK) {
        raise_status("ucp_worker_set_am_recv_handler", st);
        return -1;
    }

    int prc = pthread_create(&self->thread, NULL, progress_main, self);
    if (prc != 0) {
        PyErr_Format(TransportError, "pthread_create: %s", strerror(prc));
        return -1;
    }
    self->thread_started = 1;
    engine_init_locality(self);
    return 0;
}

static void engine_shutdown(EngineObject *self)
{
    /* Called with the GIL held; releases it around every blocking step. */
    if (self->closed) return;
    /* Peers reading us in place (pvm) check this after every get: from now on they fail. */
    for (int i = 0; i < NONCE_LEN; i++) self->nonce[i] = 0;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (self->sync_ok) {
        pthread_mutex_lock(&self->lock);
        self->closed = 1;
        pthread_mutex_unlock(&self->lock);
    } else {
        self->closed = 1;
    }

    if (self->thread_started) {
        /* Close eps while the progress thread still runs, so forced closes can complete. */
        for (;;) {
            pthread_mutex_lock(&self->lock);
            peer_t *p = self->peers;
            if (p != NULL) {
                peer_detach_locked(p);
                p->refs++; /* hold it across the unlocked close */
            }
            pthread_mutex_unlock(&self->lock);
            if (p == NULL) break;
            int rc;
            Py_BEGIN_ALLOW_THREADS
            rc = peer_close(p, 5.0);
            Py_END_ALLOW_THREADS
            if (rc == 0) {
                peer_unref(p); /* our hold */
                peer_unref(p); /* the engine list's reference */
            }
            /* else leak p: a late UCX callback may still use it */
        }
        Py_BEGIN_ALLOW_THREADS
        pvm_stop_all(self);
        Py_END_ALLOW_THREADS
        self->stop = 1;
        wake(self);
        Py_BEGIN_ALLOW_THREADS
        pthread_join(self->thread, NULL);
        Py_END_ALLOW_THREADS
        self->thread_started = 0;
    }

    if (self->sync_ok) {
        pthread_mutex_lock(&self->lock);
        xfer_t *x = self->pending, *nx;
        for (; x != NULL; x = nx) {
            nx = x->next;
            xfer_finish(x, UCS_ERR_CANCELED, "engine closed");
        }
        inreq_t *r = self->in_head, *nr;
        for (; r != NULL; r = nr) {
            nr = r->next;
            free(r);
        }
        self->in_head = self->in_tail = NULL;
        self->in_count = 0;
        pthread_mutex_unlock(&self->lock);
    }

    if (self->ctx != NULL) {
        for (size_t i = 0; i < self->nregions; i++)
            if (self->regions[i].memh) ucp_mem_unmap(self->ctx, self->regions[i].memh);
        self->nregions = 0;
    }
    if (self->worker != NULL) {
        Py_BEGIN_ALLOW_THREADS
        ucp_worker_destroy(self->worker);
        Py_END_ALLOW_THREADS
        self->worker = NULL;
    }
    if (self->ctx != NULL) {
        ucp_cleanup(self->ctx);
        self->ctx = NULL;
    }
}

static void engine_dealloc(EngineObject *self)
{
    engine_shutdown(self);
    free(self->regions);
    free(self->address);
    if (self->sync_ok) {
        pthread_mutex_destroy(&self->lock);
        pthread_cond_destroy(&self->cond);
        pthread_cond_destroy(&self->pvm_cond);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int engine_check_open(EngineObject *self)
{
    if (self->closed || self->worker == NULL) {
        PyErr_SetString(TransportError, "engine is closed");
        return -1;
    }
    return 0;
}

static PyObject *engine_close(EngineObject *self, PyObject *Py_UNUSED(ignored))
{
    engine_shutdown(self);
    Py_RETURN_NONE;
}

static PyObject *engine_get_address(EngineObject *self, void *Py_UNUSED(closure))
{
    if (self->address == NULL) {
        PyErr_SetString(TransportError, "engine is not initialised");
        return NULL;
    }
    return PyBytes_FromStringAndSize(self->address, (Py_ssize_t)self->address_len);
}

static PyObject *engine_get_locality(EngineObject *self, void *Py_UNUSED(closure))
{
    if (!self->have_loc) return PyBytes_FromStringAndSize("", 0);
    return PyBytes_FromStringAndSize((const char *)&self->self_loc, sizeof(self->self_loc));
}

static PyObject *engine_get_dropped(EngineObject *self, void *Py_UNUSED(closure))
{
    uint64_t v = 0;
    if (self->sync_ok) {
        pthread_mutex_lock(&self->lock);
        v = self->dropped_am;
        pthread_mutex_unlock(&self->lock);
    }
    return PyLong_FromUnsignedLongLong(v);
}

static PyObject *engine_get_failed_replies(EngineObject *self, void *Py_UNUSED(closure))
{
    uint64_t v = 0;
    if (self->sync_ok) {
        pthread_mutex_lock(&self->lock);
        v = self->failed_replies;
        pthread_mutex_unlock(&self->lock);
    }
    return PyLong_FromUnsignedLongLong(v);
}

/* Back registered host memory with transparent huge pages (PDSERVE_KV_THP, default "collapse";
 * "advise": MADV_HUGEPAGE only; "0": leave it).  process_vm_readv pins remote pages one by one,
 * which costs ~4x in throughput on 4 KiB pages.  Only the 2 MiB-aligned interior is touched;
 * every failure (no THP, old kernel, pinned pages) is ignored: this is an optimisation. */
static void advise_hugepages(uintptr_t addr, size_t length)
{
    const char *v = getenv("PDSERVE_KV_THP");
    if (v != NULL && strcmp(v, "0") == 0) return;
    const uintptr_t huge = 2u << 20;
    uintptr_t lo = (addr + huge - 1) & ~(huge - 1), hi = (addr + length) & ~(huge - 1);
    if (hi <= lo) return;
    if (madvise((void *)lo, hi - lo, MADV_HUGEPAGE) != 0) return;
    if (v != NULL && strcmp(v, "advise") == 0) return;
    (void)madvise((void *)lo, hi - lo, MADV_COLLAPSE);
}

static PyObject *engine_register(EngineObject *self, PyObject *args)
{
    unsigned long long addr, length;
    if (!PyArg_ParseTuple(args, "KK", &addr, &length)) return NULL;
    if (engine_check_open(self)) return NULL;
    if (addr == 0 || length == 0) {
        PyErr_SetString(PyExc_ValueError, "register needs a non-null address and a length > 0");
        return NULL;
    }
    if (self->nregions == self->capregions) {
        size_t cap = self->capregions ? 2 * self->capregions : 8;
        region_t *nr = realloc(self->regions, cap * sizeof(*nr));
        if (nr == NULL) return PyErr_NoMemory();
        self->regions = nr;
        self->capregions = cap;
    }
    ucp_mem_map_params_t mp = {
        .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
        .address = (void *)(uintptr_t)addr,
        .length = (size_t)length,
    };
    ucp_mem_h memh;
    ucs_status_t st;
    st = ucp_mem_map(self->ctx, &mp, &memh); /* under the GIL, like connect */
    if (st != UCS_OK) return raise_status("ucp_mem_map", st);
    ucp_mem_attr_t ma = {.field_mask = UCP_MEM_ATTR_FIELD_MEM_TYPE};
    if (ucp_mem_query(memh, &ma) == UCS_OK && ma.mem_type == UCS_MEMORY_TYPE_HOST) {
        Py_BEGIN_ALLOW_THREADS
        advise_hugepages((uintptr_t)addr, (size_t)length);
        Py_END_ALLOW_THREADS
    }
    void *rk = NULL;
    size_t rklen = 0;
    st = ucp_rkey_pack(self->ctx, memh, &rk, &rklen);
    if (st != UCS_OK) {
        ucp_mem_unmap(self->ctx, memh);
        return raise_status("ucp_rkey_pack", st);
    }
    PyObject *packed = PyBytes_FromStringAndSize(rk, (Py_ssize_t)rklen);
    ucp_rkey_buffer_release(rk);
    if (packed == NULL) {
        ucp_mem_unmap(self->ctx, memh);
        return NULL;
    }
    self->regions[self->nregions].memh = memh;
    self->regions[self->nregions].addr = (uintptr_t)addr;
    self->regions[self->nregions].length = (size_t)length;
    self->nregions++;
    return Py_BuildValue("(nN)", (Py_ssize_t)(self->nregions - 1), packed);
}

/* Choose p's get path from the peer's locality blob (GIL held). */
static void choose_path(EngineObject *self, peer_t *p, const char *loc, Py_ssize_t len)
{
    locality_t peer;
    p->path = PATH_UCX;
    if (loc == NULL || len == 0) {
        snprintf(p->path_reason, sizeof(p->path_reason), "no locality given");
        return;
    }
    if (!same_host_enabled()) {
        snprintf(p->path_reason, sizeof(p->path_reason), "disabled by PDSERVE_KV_SAME_HOST=0");
        return;
    }
    if ((size_t)len != sizeof(peer) || memcmp(loc, LOC_MAGIC, sizeof(LOC_MAGIC)) != 0) {
        snprintf(p->path_reason, sizeof(p->path_reason), "unrecognised locality blob");
        return;
    }
    memcpy(&peer, loc, sizeof(peer));
    peer.boot_id[sizeof(peer.boot_id) - 1] = '\0';
    if (!self->loc_known) {
        snprintf(p->path_reason, sizeof(p->path_reason), "own host identity unknown");
        return;
    }
    if (strcmp(peer.boot_id, self->self_loc.boot_id) != 0) {
        snprintf(p->path_reason, sizeof(p->path_reason), "different host");
        return;
    }
    if (peer.pidns_dev != self->self_loc.pidns_dev ||
        peer.pidns_ino != self->self_loc.pidns_ino) {
        snprintf(p->path_reason, sizeof(p->path_reason), "different pid namespace");
        return;
    }
    if (peer.pid <= 0 || peer.pid > INT_MAX || peer.nonce_addr == 0) {
        snprintf(p->path_reason, sizeof(p->path_reason), "invalid locality blob");
        return;
    }
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = pvm_check_nonce((pid_t)peer.pid, peer.nonce_addr, peer.nonce);
    Py_END_ALLOW_THREADS
    if (err != 0) {
        snprintf(p->path_reason, sizeof(p->path_reason), "process_vm_readv probe of pid %d: %s",
                 (int)peer.pid,
                 err == ESTALE ? "identity mismatch (closed engine or reused pid)"
                               : strerror(err));
        return;
    }
    err = pvm_start(self);
    if (err != 0) {
        snprintf(p->path_reason, sizeof(p->path_reason), "pvm worker: %s", strerror(err));
        return;
    }
    p->path = PATH_PVM;
    p->path_reason[0] = '\0';
    p->pid = (pid_t)peer.pid;
    p->nonce_addr = peer.nonce_addr;
    memcpy(p->nonce, peer.nonce, NONCE_LEN);
}

static PyObject *engine_connect(EngineObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"address", "locality", NULL};
    Py_buffer view, lview = {0};
    int have_l = 0;
    PyObject *lobj = Py_None;
    if (engine_check_open(self)) return NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*|O", kwlist, &view, &lobj)) return NULL;
    if (lobj != Py_None) {
        if (PyObject_GetBuffer(lobj, &lview, PyBUF_SIMPLE) < 0) {
            PyBuffer_Release(&view);
            return NULL;
        }
        have_l = 1;
    }
    if (view.len == 0) {
        PyBuffer_Release(&view);
        if (have_l) PyBuffer_Release(&lview);
        PyErr_SetString(PyExc_ValueError, "empty peer address");
        return NULL;
    }
    peer_t *p = calloc(1, sizeof(*p));
    if (p == NULL) {
        PyBuffer_Release(&view);
        if (have_l) PyBuffer_Release(&lview);
        return PyErr_NoMemory();
    }
    p->eng = self;
    p->refs = 2; /* Peer object + engine list */
    pthread_mutex_init(&p->oplock, NULL);
    choose_path(self, p, have_l ? lview.buf : NULL, have_l ? lview.len : 0);
    if (have_l) PyBuffer_Release(&lview);
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .address = view.buf,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = ep_err_cb, .arg = p},
    };
    ucs_status_t st;
    /* Under the GIL: close() sets `closed` under the GIL, so no ep is created behind it. */
    st = ucp_ep_create(self->worker, &ep, &p->ep);
    PyBuffer_Release(&view);
    if (st != UCS_OK) {
        pthread_mutex_destroy(&p->oplock);
        free(p);
        return raise_status("ucp_ep_create", st);
    }
    PeerObject *po = PyObject_New(PeerObject, &PeerType);
    if (po == NULL) {
        /* Still safe: close and drop the ep. */
        Py_BEGIN_ALLOW_THREADS
        peer_close(p, 5.0);
        Py_END_ALLOW_THREADS
        pthread_mutex_destroy(&p->oplock);
        free(p);
        return NULL;
    }
    Py_INCREF(self);
    po->eng = self;
    po->p = p;
    pthread_mutex_lock(&self->lock);
    p->next = self->peers;
    if (self->peers) self->peers->prev = p;
    self->peers = p;
    pthread_mutex_unlock(&self->lock);
    wake(self);
    return (PyObject *)po;
}

static PyObject *engine_poll_requests(EngineObject *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *out = PyList_New(0);
    if (out == NULL || !self->sync_ok) return out;
    pthread_mutex_lock(&self->lock);
    inreq_t *r = self->in_head;
    self->in_head = self->in_tail = NULL;
    self->in_count = 0;
    pthread_mutex_unlock(&self->lock);
    int failed = 0;
    for (inreq_t *nr; r != NULL; r = nr) {
        nr = r->next;
        if (!failed) {
            PyObject *t = Py_BuildValue("(Ky#y#K)", (unsigned long long)r->req_id, r->data,
                                        (Py_ssize_t)r->addr_len, r->data + r->addr_len,
                                        (Py_ssize_t)r->payload_len,
                                        (unsigned long long)(uintptr_t)r->reply_ep);
            if (t == NULL || PyList_Append(out, t) < 0) failed = 1;
            Py_XDECREF(t);
        }
        free(r);
    }
    if (failed) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

static PyObject *engine_wait_requests(EngineObject *self, PyObject *args)
{
    double timeout_s;
    if (!PyArg_ParseTuple(args, "d", &timeout_s)) return NULL;
    if (!self->sync_ok) Py_RETURN_FALSE;
    int have;
    Py_BEGIN_ALLOW_THREADS
    struct timespec ts;
    deadline_from_now(&ts, timeout_s);
    pthread_mutex_lock(&self->lock);
    while (self->in_head == NULL && !self->closed) {
        if (pthread_cond_timedwait(&self->cond, &self->lock, &ts) == ETIMEDOUT) break;
    }
    have = self->in_head != NULL;
    pthread_mutex_unlock(&self->lock);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(have);
}

static ucs_status_t post_am(EngineObject *e, ucp_ep_h ep, unsigned id, send_ctx_t *c,
                            size_t hdr_len, uint32_t flags);

/* A reply message carrying a copy of `view` (released here) for request `req_id`; NULL with a
 * Python error set when out of memory or when the engine is closed. Needs the GIL. */
static send_ctx_t *reply_ctx_new(EngineObject *e, Py_buffer *view, unsigned long long req_id)
{
    send_ctx_t *c = malloc(sizeof(*c) + (size_t)view->len);
    if (c == NULL) {
        PyBuffer_Release(view);
        PyErr_NoMemory();
        return NULL;
    }
    memcpy(c->data, view->buf, (size_t)view->len);
    c->len = (size_t)view->len;
    c->eng = e;
    c->req_id = 0;
    c->hdr.rep.req_id = req_id;
    PyBuffer_Release(view);
    if (engine_check_open(e)) {
        free(c);
        return NULL;
    }
    return c;
}

static PyObject *engine_reply(EngineObject *self, PyObject *args)
{
    unsigned long long ep_handle, req_id;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "KKy*", &ep_handle, &req_id, &view)) return NULL;
    if (ep_handle == 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(TransportError, "request carried no reply endpoint");
        return NULL;
    }
    send_ctx_t *c = reply_ctx_new(self, &view, req_id);
    if (c == NULL) return NULL;
    /* Under the GIL: close() destroys the worker only after dropping it. */
    ucs_status_t st = post_am(self, (ucp_ep_h)(uintptr_t)ep_handle, AM_ID_REPLY, c,
                              sizeof(rep_hdr_t), 0);
    if (st != UCS_OK && st != UCS_INPROGRESS) return raise_status("reply send", st);
    Py_RETURN_NONE;
}

static PyMethodDef engine_methods[] = {
    {"reply", (PyCFunction)engine_reply, METH_VARARGS,
     "reply(reply_ep, req_id, payload): answer a request over UCX's reply endpoint."},
    {"register", (PyCFunction)engine_register, METH_VARARGS,
     "register(addr, length) -> (index, packed_rkey): ucp_mem_map existing memory."},
    {"connect", (PyCFunction)(void (*)(void))engine_connect, METH_VARARGS | METH_KEYWORDS,
     "connect(address, locality=None) -> Peer: ucp_ep_create with peer error handling; gets\n"
     "use process_vm_readv when `locality` shows a same-host peer that we may read."},
    {"poll_requests", (PyCFunction)engine_poll_requests, METH_NOARGS,
     "poll_requests() -> [(req_id, sender_address, payload)]: drain received requests."},
    {"wait_requests", (PyCFunction)engine_wait_requests, METH_VARARGS,
     "wait_requests(timeout_s) -> bool: block (GIL released) until a request is queued."},
    {"close", (PyCFunction)engine_close, METH_NOARGS, "close(): idempotent teardown."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef engine_getset[] = {
    {"address", (getter)engine_get_address, NULL, "worker address blob", NULL},
    {"locality", (getter)engine_get_locality, NULL,
     "same-host identity blob for connect() (b'' when the same-host path is off)", NULL},
    {"dropped_messages", (getter)engine_get_dropped, NULL, "malformed or late AMs", NULL},
    {"failed_replies", (getter)engine_get_failed_replies, NULL, "replies UCX failed to send",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kernels.native._ucxrma.Engine",
    .tp_basicsize = sizeof(EngineObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "UCP context + MULTI worker + native progress thread.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)engine_init,
    .tp_dealloc = (destructor)engine_dealloc,
    .tp_methods = engine_methods,
    .tp_getset = engine_getset,
};

/* ----------------------------------------------------------------- Peer */

static XferObject *xfer_wrap(EngineObject *e, xfer_t *x)
{
    XferObject *xo = PyObject_New(XferObject, &XferType);
    if (xo == NULL) {
        xfer_unref_locked(x);
        return NULL;
    }
    Py_INCREF(e);
    xo->eng = e;
    xo->x = x;
    return xo;
}

static int peer_usable(PeerObject *self)
{
    /* oplock held */
    if (self->p->ep_closed) {
        PyErr_SetString(TransportError, "peer is closed");
        return -1;
    }
    return 0;
}

static PyObject *peer_unpack_rkey(PeerObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"packed", "base", "length", NULL};
    Py_buffer view;
    unsigned long long base = 0, length = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*|KK", kwlist, &view, &base, &length))
        return NULL;
    if ((base == 0) != (length == 0) || base + length < base) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "give both base and length (non-zero), or neither");
        return NULL;
    }
    peer_t *p = self->p;
    PyObject *res = NULL;
    pthread_mutex_lock(&p->oplock);
    if (peer_usable(self) == 0) {
        if (p->nrkeys == p->caprkeys) {
            size_t cap = p->caprkeys ? 2 * p->caprkeys : 8;
            ucp_rkey_h *nr = realloc(p->rkeys, cap * sizeof(*nr));
            uint64_t *nb = nr ? realloc(p->rk_base, cap * sizeof(*nb)) : NULL;
            if (nb) p->rk_base = nb;
            uint64_t *nl = nb ? realloc(p->rk_len, cap * sizeof(*nl)) : NULL;
            if (nl) p->rk_len = nl;
            if (nr) p->rkeys = nr;
            if (nr == NULL || nb == NULL || nl == NULL) {
                PyErr_NoMemory();
                goto out;
            }
            p->caprkeys = cap;
        }
        ucp_rkey_h rkey;
        ucs_status_t st = ucp_ep_rkey_unpack(p->ep, view.buf, &rkey);
        if (st != UCS_OK) {
            raise_status("ucp_ep_rkey_unpack", st);
            goto out;
        }
        p->rkeys[p->nrkeys] = rkey;
        p->rk_base[p->nrkeys] = base;
        p->rk_len[p->nrkeys] = length;
        res = PyLong_FromSize_t(p->nrkeys++);
    }
out:
    pthread_mutex_unlock(&p->oplock);
    PyBuffer_Release(&view);
    return res;
}

static ucp_mem_h find_memh(EngineObject *e, uintptr_t addr, size_t len, size_t *hint)
{
    size_t n = e->nregions;
    if (n == 0) return NULL;
    region_t *r = &e->regions[*hint < n ? *hint : 0];
    if (addr >= r->addr && addr + len <= r->addr + r->length) return r->memh;
    for (size_t i = 0; i < n; i++) {
        r = &e->regions[i];
        if (addr >= r->addr && addr + len <= r->addr + r->length) {
            *hint = i;
            return r->memh;
        }
    }
    return NULL;
}

/* Queue a same-host get on the pvm workers (p->oplock held, ops validated). */
static PyObject *peer_get_pvm(EngineObject *e, peer_t *p, const uint64_t *ops, size_t n)
{
    pvm_op_t *pops = malloc((n ? n : 1) * sizeof(*pops));
    if (pops == NULL) return PyErr_NoMemory();
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        const uint64_t *op = ops + 4 * i;
        if (op[2] == 0) continue;
        pops[m].local = op[0];
        pops[m].remote = op[1];
        pops[m].len = op[2];
        m++;
    }
    pthread_mutex_lock(&e->lock);
    xfer_t *x = xfer_new(e, XK_GET, p, 2); /* Python + the job */
    if (x == NULL) {
        pthread_mutex_unlock(&e->lock);
        free(pops);
        return PyErr_NoMemory();
    }
    x->path = PATH_PVM;
    x->pops = pops;
    x->pn = m;
    if (m == 0) {
        x->pclaimed_all = x->pfinal = 1;
        xfer_finish(x, UCS_OK, "get");
        x->refs--; /* no job */
    } else {
        x->ppeer = p;
        if (e->pvm_tail) e->pvm_tail->pqnext = x;
        else e->pvm_head = x;
        e->pvm_tail = x;
        pthread_cond_broadcast(&e->pvm_cond);
    }
    pthread_mutex_unlock(&e->lock);
    return (PyObject *)xfer_wrap(e, x);
}

static PyObject *peer_get(PeerObject *self, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    EngineObject *e = self->eng;
    peer_t *p = self->p;
    ucp_mem_h *memhs = NULL;
    if (view.itemsize != 8 || view.len % 32 != 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "ops must be a C-contiguous (n, 4) array of 8-byte ints");
        return NULL;
    }
    if (engine_check_open(e)) {
        PyBuffer_Release(&view);
        return NULL;
    }
    const uint64_t *ops = view.buf;
    size_t n = (size_t)view.len / 32;
    pthread_mutex_lock(&p->oplock);
    if (peer_usable(self) < 0) goto fail_locked;
    for (size_t i = 0; i < n; i++) {
        const uint64_t *op = ops + 4 * i;
        if (op[3] >= p->nrkeys) {
            PyErr_Format(PyExc_IndexError, "op %zu: rkey index %llu out of range (have %zu)", i,
                         (unsigned long long)op[3], p->nrkeys);
            goto fail_locked;
        }
        if (op[0] == 0 || op[1] == 0) {
            PyErr_Format(PyExc_ValueError, "op %zu: null address", i);
            goto fail_locked;
        }
        if (op[0] + op[2] < op[0] || op[1] + op[2] < op[1]) {
            PyErr_Format(PyExc_ValueError, "op %zu: range wraps around", i);
            goto fail_locked;
        }
        uint64_t rb = p->rk_base[op[3]], rl = p->rk_len[op[3]];
        if (rl != 0 && op[2] != 0 && (op[1] < rb || op[1] + op[2] > rb + rl)) {
            char msg[200];
            snprintf(msg, sizeof(msg),
                     "op %zu: remote range [%#llx, +%llu) is outside region %llu [%#llx, +%llu)",
                     i, (unsigned long long)op[1], (unsigned long long)op[2],
                     (unsigned long long)op[3], (unsigned long long)rb, (unsigned long long)rl);
            PyErr_SetString(PyExc_ValueError, msg);
            goto fail_locked;
        }
    }
    if (p->path == PATH_PVM) {
        PyObject *res = peer_get_pvm(e, p, ops, n);
        pthread_mutex_unlock(&p->oplock);
        PyBuffer_Release(&view);
        return res;
    }
    memhs = malloc((n ? n : 1) * sizeof(*memhs));
    if (memhs == NULL) {
        PyErr_NoMemory();
        goto fail_locked;
    }
    size_t hint = 0;
    for (size_t i = 0; i < n; i++) memhs[i] = find_memh(e, ops[4 * i], ops[4 * i + 2], &hint);
    pthread_mutex_lock(&e->lock);
    xfer_t *x = xfer_new(e, XK_GET, p, 2); /* Python + flush callback */
    pthread_mutex_unlock(&e->lock);
    if (x == NULL) {
        PyErr_NoMemory();
        goto fail_locked;
    }

    Py_BEGIN_ALLOW_THREADS
    ucs_status_t first_err = UCS_OK;
    for (size_t i = 0; i < n; i++) {
        const uint64_t *op = ops + 4 * i;
        if (op[2] == 0) continue;
        ucp_request_param_t prm = {.op_attr_mask = 0};
        if (memhs[i] != NULL) {
            prm.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
            prm.memh = memhs[i];
        }
        ucs_status_ptr_t r = ucp_get_nbx(p->ep, (void *)(uintptr_t)op[0], (size_t)op[2], op[1],
                                         p->rkeys[op[3]], &prm);
        if (UCS_PTR_IS_ERR(r)) {
            first_err = UCS_PTR_STATUS(r);
            break;
        }
        if (r != NULL) ucp_request_free(r); /* completion is tracked by the flush below */
    }
    ucp_request_param_t fp = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
        .cb.send = flush_cb,
        .user_data = x,
    };
    ucs_status_ptr_t fr = ucp_ep_flush_nbx(p->ep, &fp);
    if (!UCS_PTR_IS_PTR(fr)) {
        ucs_status_t st = UCS_PTR_STATUS(fr);
        pthread_mutex_lock(&e->lock);
        xfer_finish(x, first_err != UCS_OK ? first_err : st, "get");
        x->refs--; /* no callback */
        pthread_mutex_unlock(&e->lock);
    } else if (first_err != UCS_OK) {
        /* The flush callback completes the transfer; remember why it must fail. */
        pthread_mutex_lock(&e->lock);
        xfer_finish(x, first_err, "get post");
        pthread_mutex_unlock(&e->lock);
    }
    wake(e);
    Py_END_ALLOW_THREADS

    pthread_mutex_unlock(&p->oplock);
    free(memhs);
    PyBuffer_Release(&view);
    return (PyObject *)xfer_wrap(e, x);

fail_locked:
    pthread_mutex_unlock(&p->oplock);
    free(memhs);
    PyBuffer_Release(&view);
    return NULL;
}

/* Post one AM (oplock held, GIL released).  Returns a send status. */
static ucs_status_t post_am(EngineObject *e, ucp_ep_h ep, unsigned id, send_ctx_t *c,
                            size_t hdr_len, uint32_t flags)
{
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_FLAGS,
        .flags = UCP_AM_SEND_FLAG_EAGER | flags,
        .cb.send = am_send_cb,
        .user_data = c,
    };
    ucs_status_ptr_t r = ucp_am_send_nbx(ep, id, &c->hdr, hdr_len, c->data, c->len, &prm);
    if (UCS_PTR_IS_PTR(r)) {
        wake(e);
        return UCS_INPROGRESS; /* am_send_cb frees c */
    }
    free(c);
    return UCS_PTR_STATUS(r);
}

static PyObject *peer_request(PeerObject *self, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    EngineObject *e = self->eng;
    peer_t *p = self->p;
    if (engine_check_open(e)) {
        PyBuffer_Release(&view);
        return NULL;
    }
    send_ctx_t *c = malloc(sizeof(*c) + e->address_len + (size_t)view.len);
    if (c == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    memcpy(c->data, e->address, e->address_len);
    memcpy(c->data + e->address_len, view.buf, (size_t)view.len);
    c->len = e->address_len + (size_t)view.len;
    c->eng = e;
    PyBuffer_Release(&view);

    pthread_mutex_lock(&p->oplock);
    if (peer_usable(self) < 0) {
        pthread_mutex_unlock(&p->oplock);
        free(c);
        return NULL;
    }
    pthread_mutex_lock(&e->lock);
    /* Python + reply path (reply, peer error, send error or abort drops it). */
    xfer_t *x = xfer_new(e, XK_REQUEST, p, 2);
    if (x != NULL) x->req_id = e->next_req_id++;
    pthread_mutex_unlock(&e->lock);
    if (x == NULL) {
        pthread_mutex_unlock(&p->oplock);
        free(c);
        return PyErr_NoMemory();
    }
    c->req_id = x->req_id;
    c->hdr.req.req_id = x->req_id;
    c->hdr.req.addr_len = (uint32_t)e->address_len;
    c->hdr.req.reserved = 0;
    ucs_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = post_am(e, p->ep, AM_ID_REQUEST, c, sizeof(req_hdr_t), UCP_AM_SEND_FLAG_REPLY);
    Py_END_ALLOW_THREADS
    pthread_mutex_unlock(&p->oplock);
    if (st != UCS_OK && st != UCS_INPROGRESS) {
        pthread_mutex_lock(&e->lock);
        xfer_finish(x, st, "request send");
        pthread_mutex_unlock(&e->lock);
    }
    return (PyObject *)xfer_wrap(e, x);
}

static PyObject *peer_reply(PeerObject *self, PyObject *args)
{
    unsigned long long req_id;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "Ky*", &req_id, &view)) return NULL;
    EngineObject *e = self->eng;
    peer_t *p = self->p;
    send_ctx_t *c = reply_ctx_new(e, &view, req_id);
    if (c == NULL) return NULL;
    pthread_mutex_lock(&p->oplock);
    if (peer_usable(self) < 0) {
        pthread_mutex_unlock(&p->oplock);
        free(c);
        return NULL;
    }
    ucs_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = post_am(e, p->ep, AM_ID_REPLY, c, sizeof(rep_hdr_t), 0);
    Py_END_ALLOW_THREADS
    pthread_mutex_unlock(&p->oplock);
    if (st != UCS_OK && st != UCS_INPROGRESS) return raise_status("reply send", st);
    Py_RETURN_NONE;
}

static PyObject *peer_abort(PeerObject *self, PyObject *args)
{
    double timeout_s = 5.0;
    if (!PyArg_ParseTuple(args, "|d", &timeout_s)) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = peer_close(self->p, timeout_s);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        PyErr_SetString(TransportError, "endpoint close did not complete before the deadline");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *peer_get_failed(PeerObject *self, void *Py_UNUSED(closure))
{
    EngineObject *e = self->eng;
    pthread_mutex_lock(&e->lock);
    int f = self->p->failed;
    pthread_mutex_unlock(&e->lock);
    return PyBool_FromLong(f);
}

static PyObject *peer_get_closed(PeerObject *self, void *Py_UNUSED(closure))
{
    pthread_mutex_lock(&self->p->oplock);
    int c = self->p->ep_closed;
    pthread_mutex_unlock(&self->p->oplock);
    return PyBool_FromLong(c);
}

static PyObject *peer_get_path(PeerObject *self, void *Py_UNUSED(closure))
{
    return PyUnicode_FromString(self->p->path == PATH_PVM ? "pvm" : "ucx");
}

static PyObject *peer_get_path_reason(PeerObject *self, void *Py_UNUSED(closure))
{
    if (self->p->path == PATH_PVM) Py_RETURN_NONE;
    return PyUnicode_FromString(self->p->path_reason);
}

static PyObject *peer_get_fail_reason(PeerObject *self, void *Py_UNUSED(closure))
{
    EngineObject *e = self->eng;
    pthread_mutex_lock(&e->lock);
    int f = self->p->failed;
    ucs_status_t st = self->p->fail_status;
    pthread_mutex_unlock(&e->lock);
    if (!f) Py_RETURN_NONE;
    return PyUnicode_FromString(ucs_status_string(st));
}

static void peer_dealloc(PeerObject *self)
{
    peer_t *p = self->p;
    EngineObject *e = self->eng;
    if (p != NULL) {
        int rc = 0;
        Py_BEGIN_ALLOW_THREADS
        rc = peer_close(p, 5.0);
        Py_END_ALLOW_THREADS
        if (rc == 0) {
            pthread_mutex_lock(&e->lock);
            int listed = (e->peers == p) || p->prev != NULL;
            if (listed) peer_detach_locked(p);
            pthread_mutex_unlock(&e->lock);
            if (listed) peer_unref(p);
            peer_unref(p);
        }
    }
    Py_XDECREF(e);
    PyObject_Free(self);
}

static PyMethodDef peer_methods[] = {
    {"unpack_rkey", (PyCFunction)(void (*)(void))peer_unpack_rkey, METH_VARARGS | METH_KEYWORDS,
     "unpack_rkey(packed, base=0, length=0) -> index used in get() ops; with base/length,\n"
     "get() rejects ops reading outside [base, base + length)."},
    {"get", (PyCFunction)peer_get, METH_O,
     "get(ops) -> Xfer: ucp_get_nbx per row (local, remote, nbytes, rkey), then ep flush."},
    {"request", (PyCFunction)peer_request, METH_O, "request(payload) -> Xfer awaiting a reply."},
    {"reply", (PyCFunction)peer_reply, METH_VARARGS, "reply(req_id, payload): fire and forget."},
    {"abort", (PyCFunction)peer_abort, METH_VARARGS,
     "abort(timeout_s=5): force-close the ep; outstanding ops complete with an error."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef peer_getset[] = {
    {"failed", (getter)peer_get_failed, NULL, "set by the ep error callback", NULL},
    {"closed", (getter)peer_get_closed, NULL, "ep closed (aborted or engine closed)", NULL},
    {"fail_reason", (getter)peer_get_fail_reason, NULL, "UCX status string or None", NULL},
    {"path", (getter)peer_get_path, NULL, "'pvm' (same-host process_vm_readv) or 'ucx'", NULL},
    {"path_reason", (getter)peer_get_path_reason, NULL, "why gets use UCX (None for pvm)",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PeerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kernels.native._ucxrma.Peer",
    .tp_basicsize = sizeof(PeerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A UCP endpoint to one remote worker.",
    .tp_dealloc = (destructor)peer_dealloc,
    .tp_methods = peer_methods,
    .tp_getset = peer_getset,
};

/* ----------------------------------------------------------------- Xfer */

static PyObject *xfer_state(XferObject *self, PyObject *Py_UNUSED(ignored))
{
    pthread_mutex_lock(&self->eng->lock);
    int s = self->x->state;
    pthread_mutex_unlock(&self->eng->lock);
    return PyLong_FromLong(s);
}

static PyObject *xfer_wait(XferObject *self, PyObject *args)
{
    double timeout_s;
    if (!PyArg_ParseTuple(args, "d", &timeout_s)) return NULL;
    int s;
    Py_BEGIN_ALLOW_THREADS
    s = wait_xfer(self->x, timeout_s);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(s);
}

static PyObject *xfer_result(XferObject *self, PyObject *Py_UNUSED(ignored))
{
    pthread_mutex_lock(&self->eng->lock);
    int s = self->x->state;
    pthread_mutex_unlock(&self->eng->lock);
    if (s != XS_DONE) {
        PyErr_SetString(TransportError, "transfer is not done");
        return NULL;
    }
    if (self->x->reply == NULL) return PyBytes_FromStringAndSize("", 0);
    return PyBytes_FromStringAndSize(self->x->reply, (Py_ssize_t)self->x->reply_len);
}

static PyObject *xfer_get_error(XferObject *self, void *Py_UNUSED(closure))
{
    pthread_mutex_lock(&self->eng->lock);
    int s = self->x->state;
    pthread_mutex_unlock(&self->eng->lock);
    if (s != XS_ERROR) Py_RETURN_NONE;
    return PyUnicode_FromString(self->x->err);
}

static void xfer_dealloc(XferObject *self)
{
    if (self->x) xfer_unref_locked(self->x);
    Py_XDECREF(self->eng);
    PyObject_Free(self);
}

static PyMethodDef xfer_methods[] = {
    {"state", (PyCFunction)xfer_state, METH_NOARGS, "0 pending, 1 done, 2 error"},
    {"wait", (PyCFunction)xfer_wait, METH_VARARGS, "wait(timeout_s) -> state (GIL released)"},
    {"result", (PyCFunction)xfer_result, METH_NOARGS, "reply bytes (b'' for gets)"},
    {NULL, NULL, 0, NULL},
};

static PyObject *xfer_get_path(XferObject *self, void *Py_UNUSED(closure))
{
    if (self->x->kind != XK_GET) Py_RETURN_NONE;
    return PyUnicode_FromString(self->x->path == PATH_PVM ? "pvm" : "ucx");
}

static PyGetSetDef xfer_getset[] = {
    {"error", (getter)xfer_get_error, NULL, "error text or None", NULL},
    {"path", (getter)xfer_get_path, NULL, "gets: 'pvm' or 'ucx'; requests: None", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject XferType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kernels.native._ucxrma.Xfer",
    .tp_basicsize = sizeof(XferObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Completion handle of a get or a request.",
    .tp_dealloc = (destructor)xfer_dealloc,
    .tp_methods = xfer_methods,
    .tp_getset = xfer_getset,
};

/* --------------------------------------------------------------- module */

static PyObject *mod_version(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(ignored))
{
    return PyUnicode_FromString(ucp_get_version_string());
}

static PyMethodDef module_methods[] = {
    {"ucp_version", mod_version, METH_NOARGS, "libucp version string"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_ucxrma", "One-sided UCX RMA transport over libucp.", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__ucxrma(void)
{
    if (PyType_Ready(&EngineType) < 0 || PyType_Ready(&PeerType) < 0 ||
        PyType_Ready(&XferType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    TransportError = PyErr_NewException("kernels.native._ucxrma.NativeTransportError", NULL, NULL);
    if (TransportError == NULL || PyModule_AddObjectRef(m, "NativeTransportError", TransportError) < 0 ||
        PyModule_AddObjectRef(m, "Engine", (PyObject *)&EngineType) < 0 ||
        PyModule_AddObjectRef(m, "Peer", (PyObject *)&PeerType) < 0 ||
        PyModule_AddObjectRef(m, "Xfer", (PyObject *)&XferType) < 0 ||
        PyModule_AddIntConstant(m, "PENDING", XS_PENDING) < 0 ||
        PyModule_AddIntConstant(m, "DONE", XS_DONE) < 0 ||
        PyModule_AddIntConstant(m, "ERROR", XS_ERROR) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
