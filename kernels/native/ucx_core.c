/* UCX core of _ucxrma: context and worker, progress thread, callbacks, registration, GETs,
 * active messages, endpoint close, and what this libucp is.  See ucxrma.h for ownership and
 * lock order. */
#define _GNU_SOURCE
#include "ucxrma.h"

#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ helpers */

void deadline_from_now(struct timespec *ts, double timeout_s)
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

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

/* ---------------------------------------------------------------- transfers */

xfer_t *xfer_new(EngineObject *e, int kind, peer_t *p, int refs)
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

/* Move x out of XS_PENDING.  A request's reply path owns one reference for as long as the
 * request is pending; it is dropped here, so x may be freed on return. */
void xfer_finish(xfer_t *x, ucs_status_t st, const char *why)
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

void xfer_fail_msg(xfer_t *x, ucs_status_t st, const char *msg)
{
    if (x->state != XS_PENDING) return;
    /* xfer_finish drops a request's own reference: hold one so the message is never written
     * into freed memory, whatever kind of transfer fails here */
    x->refs++;
    xfer_finish(x, st, "");
    snprintf(x->err, sizeof(x->err), "%s", msg);
    xfer_unref(x);
}

void xfer_unref(xfer_t *x)
{
    if (--x->refs > 0) return;
    if (x->state == XS_PENDING) xfer_unlink(x);
    free(x->reply);
    free(x->pops);
    free(x);
}

void xfer_unref_locked(xfer_t *x)
{
    EngineObject *e = x->eng;
    pthread_mutex_lock(&e->lock);
    xfer_unref(x);
    pthread_mutex_unlock(&e->lock);
}

/* Wait (GIL released by caller) until x leaves XS_PENDING or the deadline passes. */
int wait_xfer(xfer_t *x, double timeout_s)
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
    if (status != UCS_OK) {
        pthread_mutex_lock(&e->lock);
        if (c->req_id == 0) {
            e->failed_replies++;
        } else {
            for (xfer_t *x = e->pending; x != NULL; x = x->next) {
                if (x->kind == XK_REQUEST && x->req_id == c->req_id) {
                    xfer_finish(x, status, "request send");
                    break;
                }
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
    /* Requests wait for a reply UCX knows nothing about, and gets run on the data ep, which
     * has no error handling: fail both here.  abort() force-closes the data ep, after which
     * no byte of those gets can land. */
    xfer_t *x = e->pending, *nx;
    for (; x != NULL; x = nx) {
        nx = x->next;
        /* Same-host gets report the peer's death themselves (ESRCH, nonce check). */
        if (x->peer == p && (x->kind == XK_REQUEST || (x->kind == XK_GET && x->path == PATH_UCX)))
            xfer_finish(x, status, "peer failed");
    }
    pthread_cond_broadcast(&e->cond);
    pthread_mutex_unlock(&e->lock);
}

static void count_dropped(EngineObject *e)
{
    pthread_mutex_lock(&e->lock);
    e->dropped_am++;
    pthread_mutex_unlock(&e->lock);
}

static ucs_status_t am_request_cb(void *arg, const void *header, size_t header_length, void *data,
                                  size_t length, const ucp_am_recv_param_t *param)
{
    EngineObject *e = arg;
    req_hdr_t h;
    if (header_length != sizeof(h) || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        count_dropped(e);
        return UCS_OK;
    }
    memcpy(&h, header, sizeof(h));
    if (h.addr_len > length) {
        count_dropped(e);
        return UCS_OK;
    }
    inreq_t *r = malloc(sizeof(*r) + length);
    if (r == NULL) return UCS_OK;
    r->next = NULL;
    /* param->reply_ep is not kept: UCX may destroy it once the requester fails (see ucx_reply) */
    r->req_id = h.req_id;
    r->addr_len = h.addr_len;
    r->payload_len = length - h.addr_len;
    if (length) memcpy(r->data, data, length);
    pthread_mutex_lock(&e->lock);
    if (e->in_count >= IN_QUEUE_MAX) { /* a flood: drop, never grow without bound */
        e->dropped_am++;
        pthread_mutex_unlock(&e->lock);
        free(r);
        return UCS_OK;
    }
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
        count_dropped(e);
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

void wake(EngineObject *e)
{
    if (e->opt.wakeup) ucp_worker_signal(e->worker);
}

static int stopping(EngineObject *e)
{
    return __atomic_load_n(&e->stop, __ATOMIC_ACQUIRE);
}

/* Poll while there is work, and `spin_us` beyond it, so that a busy transfer (notably
 * software-emulated RMA over tcp, where the target must serve every GET) is not slowed down by a
 * wake-up per message, while an idle worker costs no CPU. */
static void *progress_main(void *arg)
{
    EngineObject *e = arg;
    struct pollfd pfd = {.fd = e->efd, .events = POLLIN};
    const double spin_us = e->opt.spin_us;
    while (!stopping(e)) {
        double last = now_us();
        for (;;) {
            if (stopping(e)) break;
            if (ucp_worker_progress(e->worker)) {
                last = now_us();
                continue;
            }
            if (now_us() - last >= spin_us) break;
        }
        if (stopping(e)) break;
        if (!e->opt.wakeup) {
            /* No event fd (UCP_FEATURE_WAKEUP off so that event-less transports such as cma
             * qualify for RMA lanes): back off up to 1 ms between idle polls. */
            long sleep_us = 20;
            while (!stopping(e) && !ucp_worker_progress(e->worker)) {
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

/* ------------------------------------------------------------ engine life */

ucs_status_t ucx_engine_open(EngineObject *e, const char *name, const char **what)
{
    ucp_config_t *cfg = NULL;
    ucs_status_t st = ucp_config_read(NULL, NULL, &cfg); /* honours UCX_* */
    *what = "ucp_config_read";
    if (st != UCS_OK) return st;
    ucp_params_t prm = {
        .field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME,
        .features = UCP_FEATURE_RMA | UCP_FEATURE_AM | (e->opt.wakeup ? UCP_FEATURE_WAKEUP : 0),
        .name = name,
    };
    st = ucp_init(&prm, cfg, &e->ctx);
    ucp_config_release(cfg);
    *what = "ucp_init";
    if (st != UCS_OK) {
        e->ctx = NULL;
        return st;
    }
    char *info = ucx_context_info(e);
    e->has_cma = info != NULL && strstr(info, "-- cma/") != NULL;
    /* UCX's CUDA_IPC_ENABLE_GET_ZCOPY=auto turns GETs over CUDA IPC off wherever NVML reports no
     * NVLink (one GPU, PCIe boxes), and a pull of device memory then falls back to message
     * emulation over tcp (0.5 GB/s on an H200, bench/gpu_check.sh).  A pull is all GETs, so
     * unless the user chose, the cuda_ipc interface that ucp_worker_create opens reads "y".  Set
     * only when this context has cuda_ipc (else UCX warns of an unused variable) and only around
     * the worker's creation, so child processes do not inherit it. */
    const int ipc_get = info != NULL && strstr(info, "-- cuda_ipc/") != NULL &&
                        getenv(CUDA_IPC_GET_ENV) == NULL;
    free(info);
    if (ipc_get) setenv(CUDA_IPC_GET_ENV, "y", 0);
    ucp_worker_params_t wp = {
        .field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
        .thread_mode = UCS_THREAD_MODE_MULTI,
    };
    st = ucp_worker_create(e->ctx, &wp, &e->worker);
    if (ipc_get) unsetenv(CUDA_IPC_GET_ENV);
    *what = "ucp_worker_create";
    if (st != UCS_OK) {
        e->worker = NULL;
        return st;
    }
    ucp_worker_attr_t wa = {
        .field_mask = UCP_WORKER_ATTR_FIELD_THREAD_MODE | UCP_WORKER_ATTR_FIELD_ADDRESS,
    };
    st = ucp_worker_query(e->worker, &wa);
    *what = "ucp_worker_query";
    if (st != UCS_OK) return st;
    if (wa.thread_mode != UCS_THREAD_MODE_MULTI) {
        ucp_worker_release_address(e->worker, wa.address);
        *what = "libucp was built without multi-thread support";
        return UCS_ERR_UNSUPPORTED;
    }
    e->address = malloc(wa.address_length);
    if (e->address != NULL) memcpy(e->address, wa.address, wa.address_length);
    e->address_len = wa.address_length;
    ucp_worker_release_address(e->worker, wa.address);
    *what = "address";
    if (e->address == NULL) return UCS_ERR_NO_MEMORY;
    if (e->opt.wakeup) {
        st = ucp_worker_get_efd(e->worker, &e->efd);
        *what = "ucp_worker_get_efd";
        if (st != UCS_OK) return st;
    }
    ucp_am_handler_param_t ah = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG,
        .id = AM_ID_REQUEST,
        .cb = am_request_cb,
        .arg = e,
    };
    st = ucp_worker_set_am_recv_handler(e->worker, &ah);
    if (st == UCS_OK) {
        ah.id = AM_ID_REPLY;
        ah.cb = am_reply_cb;
        st = ucp_worker_set_am_recv_handler(e->worker, &ah);
    }
    *what = "ucp_worker_set_am_recv_handler";
    if (st != UCS_OK) return st;
    int rc = pthread_create(&e->thread, NULL, progress_main, e);
    *what = "pthread_create";
    if (rc != 0) return UCS_ERR_NO_RESOURCE;
    e->thread_started = 1;
    return UCS_OK;
}

/* Close every listed peer's ep while the progress thread still runs, so forced closes can
 * complete (GIL released by caller). */
void ucx_close_peers(EngineObject *e)
{
    for (;;) {
        pthread_mutex_lock(&e->lock);
        peer_t *p = e->peers;
        if (p != NULL) {
            peer_detach_locked(p);
            p->refs++; /* hold it across the unlocked close */
        }
        pthread_mutex_unlock(&e->lock);
        if (p == NULL) break;
        if (peer_close(p, 5.0) == 0) {
            peer_unref(p); /* our hold */
            peer_unref(p); /* the engine list's reference */
        }
        /* else leak p: a late UCX callback may still use it */
    }
}

void ucx_stop_progress(EngineObject *e)
{
    if (!e->thread_started) return;
    __atomic_store_n(&e->stop, 1, __ATOMIC_RELEASE);
    wake(e);
    pthread_join(e->thread, NULL);
    e->thread_started = 0;
}

/* Unmap memory, destroy the worker and the context (no other thread uses them any more). */
void ucx_engine_release(EngineObject *e)
{
    if (e->ctx != NULL) {
        for (size_t i = 0; i < e->nregions; i++)
            if (e->regions[i].memh) ucp_mem_unmap(e->ctx, e->regions[i].memh);
        e->nregions = 0;
    }
    if (e->worker != NULL) {
        ucp_worker_destroy(e->worker);
        e->worker = NULL;
    }
    if (e->ctx != NULL) {
        ucp_cleanup(e->ctx);
        e->ctx = NULL;
    }
}

/* ------------------------------------------------------------ registration */

uint64_t ucx_memory_types(EngineObject *e)
{
    ucp_context_attr_t a = {.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES};
    if (e->ctx == NULL || ucp_context_query(e->ctx, &a) != UCS_OK) return 0;
    return a.memory_types;
}

/* ucp_mem_map existing memory and pack its rkey.  want_type < 0 lets UCX detect the memory
 * type; UCS_MEMORY_TYPE_CUDA requires a context with CUDA support (a cuda transport loaded). */
ucs_status_t ucx_register(EngineObject *e, uintptr_t addr, size_t length, int want_type,
                          region_t *out, void **rkey, size_t *rkey_len, const char **what)
{
    ucp_mem_map_params_t mp = {
        .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
        .address = (void *)addr,
        .length = length,
    };
    if (want_type >= 0) {
        if (want_type != UCS_MEMORY_TYPE_HOST &&
            !(ucx_memory_types(e) & UCS_BIT(want_type))) {
            *what = "this UCX cannot register that memory type (no transport for it loaded)";
            return UCS_ERR_UNSUPPORTED;
        }
        mp.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
        mp.memory_type = (ucs_memory_type_t)want_type;
    }
    ucp_mem_h memh;
    ucs_status_t st = ucp_mem_map(e->ctx, &mp, &memh);
    *what = "ucp_mem_map";
    if (st != UCS_OK) return st;
    ucp_mem_attr_t ma = {.field_mask = UCP_MEM_ATTR_FIELD_MEM_TYPE};
    out->mem_type = ucp_mem_query(memh, &ma) == UCS_OK ? ma.mem_type : UCS_MEMORY_TYPE_HOST;
    st = ucp_rkey_pack(e->ctx, memh, rkey, rkey_len);
    *what = "ucp_rkey_pack";
    if (st != UCS_OK) {
        ucp_mem_unmap(e->ctx, memh);
        return st;
    }
    out->memh = memh;
    out->addr = addr;
    out->length = length;
    return UCS_OK;
}

/* The registered region holding [addr, addr + len) (eng->lock held), NULL if none. */
ucp_mem_h find_region(EngineObject *e, uintptr_t addr, size_t len, size_t *hint,
                      ucs_memory_type_t *mem_type)
{
    size_t n = e->nregions;
    if (n == 0) return NULL;
    for (size_t k = 0; k <= n; k++) {
        size_t i = k == 0 ? (*hint < n ? *hint : 0) : k - 1;
        region_t *r = &e->regions[i];
        if (addr >= r->addr && addr + len <= r->addr + r->length) {
            *hint = i;
            if (mem_type) *mem_type = r->mem_type;
            return r->memh;
        }
    }
    return NULL;
}

/* ------------------------------------------------------------------- ops */

static void close_now(EngineObject *e, ucp_ep_h ep);

/* The control ep (peer error handling) and the data ep.  The data ep goes without UCX error
 * handling only where that buys the cma lane: a peer on this kernel boot and pid namespace, with
 * cma among our resources, that UCX reads from (not the pvm path, whose reads bypass UCX).  A
 * dead cma peer fails the read in the posting call.  Everywhere else (tcp, IB, another pid
 * namespace) UCX leaves a peer failure undefined without error handling: a flush was seen to
 * complete OK over tcp after the peer died mid-transfer, with the bytes never written.  So those
 * data eps keep peer error handling.  On the pvm path the data ep keeps it too: UCX pairs the
 * eps two workers open to each other in creation order, and when both engines request from each
 * other (flex workers) a data ep without error handling was paired with the other side's control
 * or reply ep ("asymmetric endpoint configuration"), and every request on that connection hung
 * until its timeout.  p's path and locality fields are set by then. */
ucs_status_t ucx_ep_create(EngineObject *e, peer_t *p, const void *address)
{
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .address = address,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = ep_err_cb, .arg = p},
    };
    ucs_status_t st = ucp_ep_create(e->worker, &ep, &p->ep);
    if (st != UCS_OK) return st;
    ucp_ep_params_t dep = ep;
    p->dep_err_handling = !(p->path != PATH_PVM && p->same_boot && p->same_pidns && e->has_cma);
    if (!p->dep_err_handling) {
        dep.field_mask &= ~(uint64_t)UCP_EP_PARAM_FIELD_ERR_HANDLER;
        dep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    }
    st = ucp_ep_create(e->worker, &dep, &p->dep);
    if (st != UCS_OK) close_now(e, p->ep);
    return st;
}

/* Post one GET per op and one ep flush completing x (oplock held, GIL released).  x holds a
 * reference for the flush callback; returns the first posting error (x then fails too). */
ucs_status_t ucx_post_gets(EngineObject *e, peer_t *p, const uint64_t *ops, size_t n,
                           ucp_mem_h *memhs, xfer_t *x)
{
    ucs_status_t first_err = UCS_OK;
    for (size_t i = 0; i < n; i++) {
        const uint64_t *op = ops + 4 * i;
        if (op[2] == 0) continue;
        ucp_request_param_t prm = {.op_attr_mask = 0};
        if (memhs[i] != NULL) {
            prm.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
            prm.memh = memhs[i];
        }
        ucs_status_ptr_t r = ucp_get_nbx(p->dep, (void *)(uintptr_t)op[0], (size_t)op[2], op[1],
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
    ucs_status_ptr_t fr = ucp_ep_flush_nbx(p->dep, &fp);
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
    return first_err;
}

/* Post one AM (GIL released).  Returns a send status; c is freed here or by am_send_cb. */
ucs_status_t post_am(EngineObject *e, ucp_ep_h ep, unsigned id, send_ctx_t *c, size_t hdr_len,
                     uint32_t flags)
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
        return UCS_INPROGRESS;
    }
    free(c);
    return UCS_PTR_STATUS(r);
}

/* ------------------------------------------------------------- peer core */

void peer_unref(peer_t *p)
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
    free(p->raddr);
    free(p);
}

/* Force-close one ep and wait for the close to complete (GIL released by caller, p->oplock
 * held).  0, or -1 when it did not complete before the deadline. */
static int close_ep(EngineObject *e, peer_t *p, ucp_ep_h ep, double timeout_s)
{
    int rc = 0;
    pthread_mutex_lock(&e->lock);
    xfer_t *cx = xfer_new(e, XK_CLOSE, p, 2);
    pthread_mutex_unlock(&e->lock);
    if (cx == NULL) return -1;
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                        UCP_OP_ATTR_FIELD_USER_DATA,
        .flags = UCP_EP_CLOSE_FLAG_FORCE,
        .cb.send = close_cb,
        .user_data = cx,
    };
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &prm);
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
    if (rc == 0) xfer_finish(cx, UCS_OK, "close");
    xfer_unref(cx);
    pthread_mutex_unlock(&e->lock);
    return rc;
}

/* Force-close an ep nobody used yet, without waiting (its close completes in progress). */
static void close_now(EngineObject *e, ucp_ep_h ep)
{
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                               .flags = UCP_EP_CLOSE_FLAG_FORCE};
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &prm);
    if (UCS_PTR_IS_PTR(r)) ucp_request_free(r);
    wake(e);
}

/* Force-close both eps (GIL released by caller).  Returns 0 when the close completed, -1 when it
 * timed out (then the peer_t must be leaked, because UCX may still call its error callback). */
int peer_close(peer_t *p, double timeout_s)
{
    EngineObject *e = p->eng;
    int rc = 0;
    pthread_mutex_lock(&p->oplock);
    if (!p->ep_closed) {
        p->ep_closed = 1;
        /* No new get can start (oplock, ep_closed); cancel and wait out same-host reads. */
        if (p->path == PATH_PVM && pvm_drain_peer(p, timeout_s) != 0) rc = -1;
        /* Data ep first: once its forced close completed no GET can land any more. */
        if (p->dep != NULL && close_ep(e, p, p->dep, timeout_s) != 0) rc = -1;
        if (close_ep(e, p, p->ep, timeout_s) != 0) rc = -1;
        pthread_mutex_lock(&e->lock);
        fail_peer_xfers(p, UCS_ERR_CANCELED, "aborted", (1 << XK_GET) | (1 << XK_REQUEST));
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
void peer_detach_locked(peer_t *p)
{
    EngineObject *e = p->eng;
    if (p->prev) p->prev->next = p->next;
    else if (e->peers == p) e->peers = p->next;
    if (p->next) p->next->prev = p->prev;
    p->prev = p->next = NULL;
    for (xfer_t *x = e->pending; x != NULL; x = x->next)
        if (x->peer == p) x->peer = NULL;
}

/* ------------------------------------------------------------- replies */

/* Our endpoint to a requester (peer error handling, ep_err_cb).  UCX pairs it with the
 * requester's endpoints to us that it still holds, in creation order (connection matching), or
 * connects anew; when the one in line is a data ep without error handling, UCX refuses the
 * pairing (UNSUPPORTED, "asymmetric endpoint configuration") and drops that half, so a few tries
 * reach a pairing that works or a fresh connection. */
static ucs_status_t reply_ep_create(EngineObject *e, peer_t *p)
{
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .address = (const ucp_address_t *)p->raddr,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = ep_err_cb, .arg = p},
    };
    ucs_status_t st = UCS_ERR_UNSUPPORTED;
    for (int i = 0; i < 4 && st == UCS_ERR_UNSUPPORTED; i++)
        st = ucp_ep_create(e->worker, &ep, &p->ep);
    return st;
}

/* Close and release reply peers taken off the list (replylock held, GIL released). */
static void reply_peers_drop(peer_t **victims, int n)
{
    for (int i = 0; i < n; i++) {
        if (victims[i] == NULL) continue;
        /* a close that times out leaks the peer_t: a late UCX callback may still use it */
        if (peer_close(victims[i], 1.0) == 0) peer_unref(victims[i]);
    }
}

/* Our reply peer for `addr`, created when there is none or the one we had failed and `vouched`
 * (replylock held, GIL released).  NULL with *st and *what set when no endpoint could be
 * created; NULL with *st == UCS_OK for a requester not vouched for that has no live one. */
static peer_t *reply_peer(EngineObject *e, const void *addr, size_t len, int vouched,
                          ucs_status_t *st, const char **what)
{
    peer_t *victims[2] = {NULL, NULL};
    size_t n = 0;
    pthread_mutex_lock(&e->lock);
    peer_t *found = NULL, *oldest = NULL;
    for (peer_t *q = e->peers; q != NULL; q = q->next) {
        if (!q->is_reply) continue;
        n++;
        if (q->raddr_len == len && memcmp(q->raddr, addr, len) == 0) found = q;
        else if (oldest == NULL || q->last_used < oldest->last_used) oldest = q;
    }
    if (found != NULL && !found->failed) {
        found->last_used = ++e->reply_clock;
        pthread_mutex_unlock(&e->lock);
        return found;
    }
    if (!vouched) { /* open no endpoint to an address only the request named (finding 15) */
        pthread_mutex_unlock(&e->lock);
        *st = UCS_OK;
        *what = "reply to a requester not vouched for";
        return NULL;
    }
    if (found != NULL) { /* failed: close it, and try a new endpoint (a new connection) */
        peer_detach_locked(found);
        victims[0] = found;
        n--;
    }
    if (n >= REPLY_PEERS_MAX && oldest != NULL) {
        peer_detach_locked(oldest);
        victims[1] = oldest;
    }
    pthread_mutex_unlock(&e->lock);
    reply_peers_drop(victims, 2);

    peer_t *p = calloc(1, sizeof(*p));
    char *copy = malloc(len);
    if (p == NULL || copy == NULL) {
        free(p);
        free(copy);
        *st = UCS_ERR_NO_MEMORY;
        *what = "reply endpoint";
        return NULL;
    }
    memcpy(copy, addr, len);
    p->eng = e;
    p->refs = 1; /* the engine list */
    p->is_reply = 1;
    p->raddr = copy;
    p->raddr_len = len;
    p->path = PATH_UCX;
    pthread_mutex_init(&p->oplock, NULL);
    *st = reply_ep_create(e, p);
    if (*st != UCS_OK) {
        *what = "reply endpoint (ucp_ep_create to the requester)";
        pthread_mutex_destroy(&p->oplock);
        free(copy);
        free(p);
        return NULL;
    }
    pthread_mutex_lock(&e->lock);
    p->last_used = ++e->reply_clock;
    p->next = e->peers;
    if (e->peers) e->peers->prev = p;
    e->peers = p;
    pthread_mutex_unlock(&e->lock);
    wake(e);
    return p;
}

ucs_status_t ucx_reply(EngineObject *e, const void *addr, size_t addr_len, int vouched,
                       send_ctx_t *c, int *stranger, const char **what)
{
    ucs_status_t st = UCS_OK;
    *what = "reply send";
    *stranger = 0;
    pthread_mutex_lock(&e->replylock);
    peer_t *p = reply_peer(e, addr, addr_len, vouched, &st, what);
    if (p == NULL && st == UCS_OK) {
        free(c);
        pthread_mutex_unlock(&e->replylock);
        pthread_mutex_lock(&e->lock);
        e->unanswered_strangers++;
        pthread_mutex_unlock(&e->lock);
        *stranger = 1;
        return UCS_OK;
    }
    if (p != NULL) {
        pthread_mutex_lock(&p->oplock);
        pthread_mutex_lock(&e->lock);
        int failed = p->failed;
        ucs_status_t fst = p->fail_status;
        pthread_mutex_unlock(&e->lock);
        if (p->ep_closed || failed) { /* failed since reply_peer looked: the next reply retries */
            st = failed ? fst : UCS_ERR_CANCELED;
            *what = "reply send (requester failed)";
            free(c);
        } else {
            st = post_am(e, p->ep, AM_ID_REPLY, c, sizeof(rep_hdr_t), 0);
        }
        pthread_mutex_unlock(&p->oplock);
    } else {
        free(c);
    }
    pthread_mutex_unlock(&e->replylock);
    if (st != UCS_OK && st != UCS_INPROGRESS) {
        pthread_mutex_lock(&e->lock);
        e->failed_replies++;
        pthread_mutex_unlock(&e->lock);
    }
    return st;
}

/* ------------------------------------------------------------ what UCX is */

/* The text ucp_context_print_info writes: components, memory domains and the resources (a
 * transport on a device) this context may use after UCX_* configuration. */
char *ucx_context_info(EngineObject *e)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (f == NULL) return NULL;
    ucp_context_print_info(e->ctx, f);
    fclose(f);
    return buf;
}

/* Path of the libucp this module is running with. */
const char *ucx_library_path(void)
{
    Dl_info info;
    if (dladdr((void *)&ucp_get_version_string, &info) == 0 || info.dli_fname == NULL)
        return "";
    return info.dli_fname;
}
