/* Same-host read path of _ucxrma: locality and nonce, process_vm_readv worker threads, huge-page
 * advice for registered host memory.  See ucxrma.h for the protocol, ownership and lock order. */
#define _GNU_SOURCE
#include "ucxrma.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/uio.h>
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

/* ------------------------------------------------------------- reading */

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

/* ---------------------------------------------------------------- jobs */

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
    const size_t chunk = x->eng->opt.pvm_chunk;
    size_t n = 0, bytes = 0;
    while (x->pcur < x->pn && n < IOV_MAX && bytes < chunk) {
        pvm_op_t *op = &x->pops[x->pcur];
        uint64_t len = op->len - x->pcur_off;
        if (len > chunk - bytes) len = chunk - bytes;
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

/* Start the workers once (takes eng->lock; concurrent callers start them once).  0 or errno. */
static int pvm_start(EngineObject *e)
{
    pthread_mutex_lock(&e->lock);
    if (e->pvm_started) {
        pthread_mutex_unlock(&e->lock);
        return 0;
    }
    int n = e->opt.pvm_threads;
    if (n <= 0) {
        /* 2 workers when we may run on 2+ CPUs (measured: 13.6 -> 19.5 GB/s for 256 MiB
         * KV-shaped pulls on a 2-core VM; one batch pins remote pages one by one, two overlap). */
        cpu_set_t cs;
        n = sched_getaffinity(0, sizeof(cs), &cs) == 0 && CPU_COUNT(&cs) >= 2 ? 2 : 1;
    }
    if (n > 16) n = 16;
    int rc = 0;
    e->pvm_threads = calloc((size_t)n, sizeof(pthread_t));
    if (e->pvm_threads == NULL) rc = ENOMEM;
    for (int i = 0; rc == 0 && i < n; i++) {
        int err = pthread_create(&e->pvm_threads[i], NULL, pvm_main, e);
        if (err != 0) {
            if (i == 0) rc = err;
            break;
        }
        e->pvm_nthreads = i + 1;
    }
    if (rc != 0) {
        free(e->pvm_threads);
        e->pvm_threads = NULL;
    } else {
        e->pvm_started = 1;
    }
    pthread_mutex_unlock(&e->lock);
    return rc;
}

/* Stop and join the workers (GIL released by caller).  Jobs still queued are cancelled. */
void pvm_stop_all(EngineObject *e)
{
    pthread_mutex_lock(&e->lock);
    if (!e->pvm_started) {
        pthread_mutex_unlock(&e->lock);
        return;
    }
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
    free(e->pvm_threads);
    e->pvm_threads = NULL;
    e->pvm_nthreads = 0;
    e->pvm_started = 0;
    pthread_mutex_unlock(&e->lock);
}

/* Cancel p's queued pvm batches and wait until none is in flight (GIL released by caller).
 * Returns 0, or -1 if a batch was still being read at the deadline. */
int pvm_drain_peer(peer_t *p, double timeout_s)
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

/* Queue a same-host get (p->oplock held, ops validated).  0 or errno; *out holds a reference for
 * the caller. */
int pvm_submit(EngineObject *e, peer_t *p, const uint64_t *ops, size_t n, xfer_t **out)
{
    pvm_op_t *pops = malloc((n ? n : 1) * sizeof(*pops));
    if (pops == NULL) return ENOMEM;
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
    xfer_t *x = xfer_new(e, XK_GET, p, 2); /* caller + the job */
    if (x == NULL) {
        pthread_mutex_unlock(&e->lock);
        free(pops);
        return ENOMEM;
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
    *out = x;
    return 0;
}

/* ------------------------------------------------------------- locality */

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

/* Set up the same-host identity (at init, before the engine is shared). */
void pvm_init_locality(EngineObject *e)
{
    e->loc_known = read_host_identity(&e->self_loc) == 0;
    if (!e->loc_known || !e->opt.same_host) return;
    /* Yama ptrace_scope=1 only lets ancestors read us: allow any same-uid reader (the usual uid,
     * capability and dumpable checks of process_vm_readv still apply).  Without Yama this fails
     * with EINVAL, which is fine. */
    (void)prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
    uint8_t nonce[NONCE_LEN];
    fill_nonce(nonce);
    memcpy((void *)e->nonce, nonce, NONCE_LEN);
    e->self_loc.nonce_addr = (uint64_t)(uintptr_t)e->nonce;
    memcpy(e->self_loc.nonce, nonce, NONCE_LEN);
    e->have_loc = 1;
}

/* From now on peers reading us in place fail their next nonce check. */
void pvm_wipe_nonce(EngineObject *e)
{
    for (int i = 0; i < NONCE_LEN; i++) e->nonce[i] = 0;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

#define REASON(...) snprintf(p->path_reason, sizeof(p->path_reason), __VA_ARGS__)

/* Choose p's get path from the peer's locality blob and note whether it runs on this kernel
 * boot (GIL released: plain C only). */
void pvm_choose_path(EngineObject *e, peer_t *p, const char *loc, size_t len)
{
    locality_t peer;
    p->path = PATH_UCX;
    if (loc == NULL || len == 0) {
        REASON("no locality given");
        return;
    }
    if (len == sizeof(peer) && memcmp(loc, LOC_MAGIC, sizeof(LOC_MAGIC)) == 0 && e->loc_known) {
        memcpy(&peer, loc, sizeof(peer));
        peer.boot_id[sizeof(peer.boot_id) - 1] = '\0';
        p->same_boot = strcmp(peer.boot_id, e->self_loc.boot_id) == 0;
        p->same_pidns = peer.pidns_dev == e->self_loc.pidns_dev &&
                        peer.pidns_ino == e->self_loc.pidns_ino;
    }
    if (!e->opt.same_host) {
        REASON("same-host path off (same_host=False)");
        return;
    }
    pthread_mutex_lock(&e->lock);
    int device = e->device_regions;
    pthread_mutex_unlock(&e->lock);
    if (device) {
        REASON("local KV memory is not host memory");
        return;
    }
    if (len != sizeof(peer) || memcmp(loc, LOC_MAGIC, sizeof(LOC_MAGIC)) != 0) {
        REASON("unrecognised locality blob");
        return;
    }
    memcpy(&peer, loc, sizeof(peer));
    peer.boot_id[sizeof(peer.boot_id) - 1] = '\0';
    if (!e->loc_known) {
        REASON("own host identity unknown");
        return;
    }
    if (strcmp(peer.boot_id, e->self_loc.boot_id) != 0) {
        REASON("different host");
        return;
    }
    if (peer.pidns_dev != e->self_loc.pidns_dev || peer.pidns_ino != e->self_loc.pidns_ino) {
        REASON("different pid namespace");
        return;
    }
    if (peer.pid <= 0 || peer.pid > INT_MAX || peer.nonce_addr == 0) {
        REASON("invalid locality blob");
        return;
    }
    int err = pvm_check_nonce((pid_t)peer.pid, peer.nonce_addr, peer.nonce);
    if (err != 0) {
        REASON("process_vm_readv probe of pid %d: %s", (int)peer.pid,
               err == ESTALE ? "identity mismatch (closed engine or reused pid)" : strerror(err));
        return;
    }
    err = pvm_start(e);
    if (err != 0) {
        REASON("pvm worker: %s", strerror(err));
        return;
    }
    p->path = PATH_PVM;
    p->path_reason[0] = '\0';
    p->pid = (pid_t)peer.pid;
    p->nonce_addr = peer.nonce_addr;
    memcpy(p->nonce, peer.nonce, NONCE_LEN);
}

/* ------------------------------------------------------------ huge pages */

/* Back registered host memory with transparent huge pages.  process_vm_readv pins remote pages
 * one by one, which costs ~4x in throughput on 4 KiB pages.  Only the 2 MiB-aligned interior is
 * touched; every failure (no THP, old kernel, pinned pages) is ignored: this is an optimisation. */
void advise_hugepages(int thp, uintptr_t addr, size_t length)
{
    if (thp == THP_OFF) return;
    const uintptr_t huge = 2u << 20;
    uintptr_t lo = (addr + huge - 1) & ~(huge - 1), hi = (addr + length) & ~(huge - 1);
    if (hi <= lo) return;
    if (madvise((void *)lo, hi - lo, MADV_HUGEPAGE) != 0) return;
    if (thp == THP_ADVISE) return;
    (void)madvise((void *)lo, hi - lo, MADV_COLLAPSE);
}
