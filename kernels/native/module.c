/* Python types of _ucxrma: Engine, Peer, Xfer, and the module.  Argument parsing, Python
 * objects and GIL handling live here; the C state they drive is in ucx_core.c and pvm.c (see
 * ucxrma.h for ownership and lock order). */
#include "ucxrma.h"

#include <errno.h>
#include <string.h>
#include <sys/random.h>

/* A request id a peer cannot guess (replies are matched by id): 64 random bits, never 0 (the
 * id of replies we send). Falls back to the sequential counter only if getrandom fails. */
static uint64_t random_req_id(EngineObject *e)
{
    uint64_t id = 0;
    while (id == 0) {
        if (getrandom(&id, sizeof(id), 0) != (ssize_t)sizeof(id)) id = e->next_req_id++;
    }
    return id;
}

#ifndef PDSERVE_UCX_SOURCE
#define PDSERVE_UCX_SOURCE "unknown"
#endif

static PyObject *TransportError;
static PyTypeObject EngineType, PeerType, XferType;

static PyObject *raise_status(const char *what, ucs_status_t st)
{
    PyErr_Format(TransportError, "%s: %s", what, ucs_status_string(st));
    return NULL;
}

static int is_closed(EngineObject *e)
{
    return __atomic_load_n(&e->closed, __ATOMIC_ACQUIRE) || e->worker == NULL;
}

/* Hold the engine open for one call: uselock shared, and not closed.  0, or -1 with an error. */
static int use_begin(EngineObject *e)
{
    if (!e->sync_ok) {
        PyErr_SetString(TransportError, "engine is not initialised");
        return -1;
    }
    pthread_rwlock_rdlock(&e->uselock);
    if (is_closed(e)) {
        pthread_rwlock_unlock(&e->uselock);
        PyErr_SetString(TransportError, "engine is closed");
        return -1;
    }
    return 0;
}

static void use_end(EngineObject *e)
{
    pthread_rwlock_unlock(&e->uselock);
}

/* ----------------------------------------------------------------- Engine */

static int parse_thp(const char *s, int *out)
{
    if (strcmp(s, "collapse") == 0) *out = THP_COLLAPSE;
    else if (strcmp(s, "advise") == 0) *out = THP_ADVISE;
    else if (strcmp(s, "off") == 0 || strcmp(s, "0") == 0) *out = THP_OFF;
    else return -1;
    return 0;
}

static int engine_init(EngineObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"name", "same_host", "pvm_threads", "pvm_chunk_kib", "thp",
                             "wakeup", "spin_us", NULL};
    const char *name = "pdserve", *thp = "collapse";
    int same_host = 1, pvm_threads = 0, wakeup = 1;
    unsigned long long chunk_kib = 4096;
    double spin_us = 200.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|s$piKspd", kwlist, &name, &same_host,
                                     &pvm_threads, &chunk_kib, &thp, &wakeup, &spin_us))
        return -1;
    if (self->sync_ok) {
        PyErr_SetString(TransportError, "Engine already initialised");
        return -1;
    }
    ucxrma_opts_t opt = {.same_host = same_host, .pvm_threads = pvm_threads,
                         .pvm_chunk = (size_t)chunk_kib << 10, .wakeup = wakeup,
                         .spin_us = spin_us < 0 ? 0 : spin_us};
    if (parse_thp(thp, &opt.thp) != 0 || chunk_kib == 0 || pvm_threads < 0) {
        PyErr_SetString(PyExc_ValueError, "thp must be collapse|advise|off, pvm_chunk_kib > 0, "
                                          "pvm_threads >= 0");
        return -1;
    }
    self->opt = opt;

    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&self->lock, NULL);
    pthread_cond_init(&self->cond, &ca);
    pthread_condattr_destroy(&ca);
    pthread_cond_init(&self->pvm_cond, NULL);
    pthread_rwlock_init(&self->uselock, NULL);
    pthread_mutex_init(&self->replylock, NULL);
    self->sync_ok = 1;
    self->efd = -1;
    self->next_req_id = 1;

    const char *what = "";
    ucs_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = ucx_engine_open(self, name, &what);
    Py_END_ALLOW_THREADS
    if (st != UCS_OK) {
        raise_status(what, st);
        return -1;
    }
    pvm_init_locality(self);
    return 0;
}

static void engine_shutdown(EngineObject *self)
{
    /* Called with the GIL held; releases it around every blocking step.  Exactly one caller
     * tears down; a concurrent second close() returns at once. */
    if (!self->sync_ok || __atomic_exchange_n(&self->shutdown_claimed, 1, __ATOMIC_ACQ_REL))
        return;
    pvm_wipe_nonce(self);
    Py_BEGIN_ALLOW_THREADS
    pthread_rwlock_wrlock(&self->uselock); /* waits for calls using the worker to finish */
    pthread_mutex_lock(&self->lock);
    __atomic_store_n(&self->closed, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&self->cond);
    pthread_mutex_unlock(&self->lock);
    pthread_rwlock_unlock(&self->uselock);
    if (self->thread_started) {
        ucx_close_peers(self);
        pvm_stop_all(self);
        ucx_stop_progress(self);
    }
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
    ucx_engine_release(self);
    Py_END_ALLOW_THREADS
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
        pthread_rwlock_destroy(&self->uselock);
        pthread_mutex_destroy(&self->replylock);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
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
    if (!__atomic_load_n(&self->have_loc, __ATOMIC_ACQUIRE)) return PyBytes_FromStringAndSize("", 0);
    return PyBytes_FromStringAndSize((const char *)&self->self_loc, sizeof(self->self_loc));
}

static PyObject *locked_counter(EngineObject *self, const uint64_t *field)
{
    uint64_t v = 0;
    if (self->sync_ok) {
        pthread_mutex_lock(&self->lock);
        v = *field;
        pthread_mutex_unlock(&self->lock);
    }
    return PyLong_FromUnsignedLongLong(v);
}

static PyObject *engine_get_dropped(EngineObject *self, void *Py_UNUSED(closure))
{
    return locked_counter(self, &self->dropped_am);
}

static PyObject *engine_get_failed_replies(EngineObject *self, void *Py_UNUSED(closure))
{
    return locked_counter(self, &self->failed_replies);
}

static PyObject *engine_get_unanswered_strangers(EngineObject *self,
                                                 void *Py_UNUSED(closure))
{
    return locked_counter(self, &self->unanswered_strangers);
}

static PyObject *engine_get_reply_peers(EngineObject *self, void *Py_UNUSED(closure))
{
    unsigned long n = 0, failed = 0;
    if (self->sync_ok) {
        pthread_mutex_lock(&self->lock);
        for (peer_t *p = self->peers; p != NULL; p = p->next) {
            if (!p->is_reply) continue;
            n++;
            failed += p->failed != 0;
        }
        pthread_mutex_unlock(&self->lock);
    }
    return Py_BuildValue("(kk)", n, failed);
}

static const char *mem_type_name(ucs_memory_type_t t)
{
    return t < UCS_MEMORY_TYPE_LAST ? ucs_memory_type_names[t] : "unknown";
}

static PyObject *engine_register(EngineObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"addr", "length", "memory_type", NULL};
    unsigned long long addr, length;
    const char *mtype = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "KK|z", kwlist, &addr, &length, &mtype))
        return NULL;
    int want = -1;
    if (mtype != NULL) {
        if (strcmp(mtype, "host") == 0) want = UCS_MEMORY_TYPE_HOST;
        else if (strcmp(mtype, "cuda") == 0) want = UCS_MEMORY_TYPE_CUDA;
        else {
            PyErr_SetString(PyExc_ValueError, "memory_type must be None, 'host' or 'cuda'");
            return NULL;
        }
    }
    if (addr == 0 || length == 0) {
        PyErr_SetString(PyExc_ValueError, "register needs a non-null address and a length > 0");
        return NULL;
    }
    if (use_begin(self)) return NULL;
    region_t reg;
    void *rk = NULL;
    size_t rklen = 0;
    const char *what = "";
    ucs_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = ucx_register(self, (uintptr_t)addr, (size_t)length, want, &reg, &rk, &rklen, &what);
    if (st == UCS_OK && reg.mem_type == UCS_MEMORY_TYPE_HOST)
        advise_hugepages(self->opt.thp, (uintptr_t)addr, (size_t)length);
    Py_END_ALLOW_THREADS
    if (st != UCS_OK) {
        use_end(self);
        return raise_status(what, st);
    }
    PyObject *packed = PyBytes_FromStringAndSize(rk, (Py_ssize_t)rklen);
    ucp_rkey_buffer_release(rk);
    Py_ssize_t index = -1;
    if (packed != NULL) {
        pthread_mutex_lock(&self->lock);
        if (self->nregions == self->capregions) {
            size_t cap = self->capregions ? 2 * self->capregions : 8;
            region_t *nr = realloc(self->regions, cap * sizeof(*nr));
            if (nr != NULL) {
                self->regions = nr;
                self->capregions = cap;
            }
        }
        if (self->nregions < self->capregions) {
            self->regions[self->nregions] = reg;
            index = (Py_ssize_t)self->nregions++;
            if (reg.mem_type != UCS_MEMORY_TYPE_HOST) {
                /* The same-host path reads host memory only: stop advertising it. */
                self->device_regions++;
                __atomic_store_n(&self->have_loc, 0, __ATOMIC_RELEASE);
            }
        }
        pthread_mutex_unlock(&self->lock);
    }
    if (index < 0) {
        ucp_mem_unmap(self->ctx, reg.memh);
        use_end(self);
        Py_XDECREF(packed);
        return packed == NULL ? NULL : PyErr_NoMemory();
    }
    use_end(self);
    return Py_BuildValue("(nNs)", index, packed, mem_type_name(reg.mem_type));
}

static PyObject *engine_connect(EngineObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"address", "locality", NULL};
    Py_buffer view, lview = {0};
    PyObject *lobj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*|O", kwlist, &view, &lobj)) return NULL;
    int have_l = 0;
    if (lobj != Py_None) {
        if (PyObject_GetBuffer(lobj, &lview, PyBUF_SIMPLE) < 0) {
            PyBuffer_Release(&view);
            return NULL;
        }
        have_l = 1;
    }
    PyObject *res = NULL;
    peer_t *p = NULL;
    if (view.len == 0) {
        PyErr_SetString(PyExc_ValueError, "empty peer address");
        goto out;
    }
    PeerObject *po = PyObject_New(PeerObject, &PeerType);
    if (po == NULL) goto out;
    po->eng = NULL;
    po->p = NULL;
    p = calloc(1, sizeof(*p));
    if (p == NULL || use_begin(self) != 0) {
        if (p == NULL) PyErr_NoMemory();
        free(p);
        Py_DECREF(po);
        goto out;
    }
    p->eng = self;
    p->refs = 2; /* Peer object + engine list */
    pthread_mutex_init(&p->oplock, NULL);
    ucs_status_t st;
    Py_BEGIN_ALLOW_THREADS
    pvm_choose_path(self, p, have_l ? lview.buf : NULL, have_l ? (size_t)lview.len : 0);
    st = ucx_ep_create(self, p, view.buf);
    if (st == UCS_OK) {
        pthread_mutex_lock(&self->lock);
        p->next = self->peers;
        if (self->peers) self->peers->prev = p;
        self->peers = p;
        pthread_mutex_unlock(&self->lock);
        wake(self);
    }
    Py_END_ALLOW_THREADS
    use_end(self);
    if (st != UCS_OK) {
        pthread_mutex_destroy(&p->oplock);
        free(p);
        Py_DECREF(po);
        raise_status("ucp_ep_create", st);
        goto out;
    }
    Py_INCREF(self);
    po->eng = self;
    po->p = p;
    res = (PyObject *)po;
out:
    PyBuffer_Release(&view);
    if (have_l) PyBuffer_Release(&lview);
    return res;
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
            PyObject *t = Py_BuildValue("(Ky#y#)", (unsigned long long)r->req_id, r->data,
                                        (Py_ssize_t)r->addr_len, r->data + r->addr_len,
                                        (Py_ssize_t)r->payload_len);
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
    while (self->in_head == NULL && !__atomic_load_n(&self->closed, __ATOMIC_ACQUIRE)) {
        if (pthread_cond_timedwait(&self->cond, &self->lock, &ts) == ETIMEDOUT) break;
    }
    have = self->in_head != NULL;
    pthread_mutex_unlock(&self->lock);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(have);
}

static PyObject *engine_reply(EngineObject *self, PyObject *args)
{
    unsigned long long req_id;
    Py_buffer sender, view;
    int vouched = 1;
    if (!PyArg_ParseTuple(args, "y*Ky*|p", &sender, &req_id, &view, &vouched)) return NULL;
    if (sender.len == 0 || sender.len > SENDER_ADDR_MAX) {
        PyBuffer_Release(&sender);
        PyBuffer_Release(&view);
        PyErr_SetString(TransportError, "request carried no usable sender address");
        return NULL;
    }
    send_ctx_t *c = malloc(sizeof(*c) + (size_t)view.len);
    if (c == NULL) {
        PyBuffer_Release(&sender);
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    memcpy(c->data, view.buf, (size_t)view.len);
    c->len = (size_t)view.len;
    c->eng = self;
    c->req_id = 0;
    c->hdr.rep.req_id = req_id;
    PyBuffer_Release(&view);
    if (use_begin(self)) {
        PyBuffer_Release(&sender);
        free(c);
        return NULL;
    }
    ucs_status_t st;
    int stranger = 0;
    const char *what = "";
    Py_BEGIN_ALLOW_THREADS
    st = ucx_reply(self, sender.buf, (size_t)sender.len, vouched, c, &stranger, &what);
    Py_END_ALLOW_THREADS
    use_end(self);
    PyBuffer_Release(&sender);
    if (st != UCS_OK && st != UCS_INPROGRESS) return raise_status(what, st);
    return PyBool_FromLong(!stranger);
}

static PyObject *engine_context_info(EngineObject *self, PyObject *Py_UNUSED(ignored))
{
    if (use_begin(self)) return NULL;
    char *text = ucx_context_info(self);
    use_end(self);
    if (text == NULL) return PyErr_NoMemory();
    PyObject *s = PyUnicode_DecodeUTF8(text, (Py_ssize_t)strlen(text), "replace");
    free(text);
    return s;
}

static PyObject *engine_get_memory_types(EngineObject *self, void *Py_UNUSED(closure))
{
    if (use_begin(self)) return NULL;
    uint64_t bits = ucx_memory_types(self);
    use_end(self);
    PyObject *out = PyList_New(0);
    for (int t = 0; out != NULL && t < UCS_MEMORY_TYPE_LAST; t++) {
        if (!(bits & UCS_BIT(t))) continue;
        PyObject *s = PyUnicode_FromString(mem_type_name((ucs_memory_type_t)t));
        if (s == NULL || PyList_Append(out, s) < 0) Py_CLEAR(out);
        Py_XDECREF(s);
    }
    return out;
}

static PyMethodDef engine_methods[] = {
    {"reply", (PyCFunction)engine_reply, METH_VARARGS,
     "reply(sender, req_id, payload, vouched=True) -> bool: answer a request over this\n"
     "engine's own endpoint to the sender's worker address (created on first use when\n"
     "vouched, kept for later replies); False: not sent, the requester has no endpoint here\n"
     "and was not vouched for (counted in unanswered_strangers)."},
    {"register", (PyCFunction)(void (*)(void))engine_register, METH_VARARGS | METH_KEYWORDS,
     "register(addr, length, memory_type=None) -> (index, packed_rkey, memory_type):\n"
     "ucp_mem_map existing memory; memory_type None lets UCX detect it, 'cuda' asks for\n"
     "device memory."},
    {"connect", (PyCFunction)(void (*)(void))engine_connect, METH_VARARGS | METH_KEYWORDS,
     "connect(address, locality=None) -> Peer: ucp_ep_create with peer error handling; gets\n"
     "use process_vm_readv when `locality` shows a same-host peer that we may read."},
    {"poll_requests", (PyCFunction)engine_poll_requests, METH_NOARGS,
     "poll_requests() -> [(req_id, sender_address, payload)]: drain requests."},
    {"wait_requests", (PyCFunction)engine_wait_requests, METH_VARARGS,
     "wait_requests(timeout_s) -> bool: block (GIL released) until a request is queued."},
    {"context_info", (PyCFunction)engine_context_info, METH_NOARGS,
     "context_info() -> str: ucp_context_print_info (components, domains, resources)."},
    {"close", (PyCFunction)engine_close, METH_NOARGS, "close(): idempotent teardown."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef engine_getset[] = {
    {"address", (getter)engine_get_address, NULL, "worker address blob", NULL},
    {"locality", (getter)engine_get_locality, NULL,
     "same-host identity blob for connect() (b'' when the same-host path is off)", NULL},
    {"dropped_messages", (getter)engine_get_dropped, NULL, "malformed or late AMs", NULL},
    {"failed_replies", (getter)engine_get_failed_replies, NULL,
     "replies that could not be sent or delivered", NULL},
    {"unanswered_strangers", (getter)engine_get_unanswered_strangers, NULL,
     "replies dropped: the requester had no endpoint here and was not vouched for", NULL},
    {"reply_peers", (getter)engine_get_reply_peers, NULL,
     "(endpoints kept to requesters for replies, how many of them failed)", NULL},
    {"memory_types", (getter)engine_get_memory_types, NULL,
     "memory types this context can register (e.g. ['host'], ['host', 'cuda', ...])", NULL},
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

/* The peer is neither closed nor failed (oplock held).  `failed` is read under Engine.lock,
 * where the error callback and the pvm workers set it, so no call starts on a peer whose
 * failure was already reported (posting GETs on a failed ep can crash UCX 1.22). */
static int peer_usable(PeerObject *self)
{
    peer_t *p = self->p;
    if (p->ep_closed) {
        PyErr_SetString(TransportError, "peer is closed");
        return -1;
    }
    pthread_mutex_lock(&p->eng->lock);
    int failed = p->failed;
    ucs_status_t st = p->fail_status;
    pthread_mutex_unlock(&p->eng->lock);
    if (failed) {
        PyErr_Format(TransportError, "peer failed: %s", ucs_status_string(st));
        return -1;
    }
    return 0;
}

static PyObject *peer_unpack_rkey(PeerObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"packed", "base", "length", NULL};
    Py_buffer view;
    unsigned long long base = 0, length = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*KK", kwlist, &view, &base, &length))
        return NULL;
    if (base == 0 || length == 0 || base + length < base) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError,
                        "unpack_rkey needs the remote region's base and length (non-zero, no "
                        "wrap-around): every get is checked against them");
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
        ucs_status_t st = ucp_ep_rkey_unpack(p->dep, view.buf, &rkey);
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

/* Check every op against p's rkeys and remote bounds (oplock held); 0 or -1 with an error. */
static int validate_ops(peer_t *p, const uint64_t *ops, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const uint64_t *op = ops + 4 * i;
        if (op[3] >= p->nrkeys) {
            PyErr_Format(PyExc_IndexError, "op %zu: rkey index %llu out of range (have %zu)", i,
                         (unsigned long long)op[3], p->nrkeys);
            return -1;
        }
        if (op[0] == 0 || op[1] == 0) {
            PyErr_Format(PyExc_ValueError, "op %zu: null address", i);
            return -1;
        }
        if (op[0] + op[2] < op[0] || op[1] + op[2] < op[1]) {
            PyErr_Format(PyExc_ValueError, "op %zu: range wraps around", i);
            return -1;
        }
        uint64_t rb = p->rk_base[op[3]], rl = p->rk_len[op[3]];
        if (op[2] != 0 && (op[1] < rb || op[1] + op[2] > rb + rl)) {
            char msg[200];
            snprintf(msg, sizeof(msg),
                     "op %zu: remote range [%#llx, +%llu) is outside region %llu [%#llx, +%llu)",
                     i, (unsigned long long)op[1], (unsigned long long)op[2],
                     (unsigned long long)op[3], (unsigned long long)rb, (unsigned long long)rl);
            PyErr_SetString(PyExc_ValueError, msg);
            return -1;
        }
    }
    return 0;
}

/* Check every op's destination against this engine's registered regions and give their memory
 * handles (out may be NULL); 0, or -1 with ValueError when a destination is not inside one
 * registered region, or is device memory on the pvm path (process_vm_readv writes host memory
 * only).  Zero-length ops move nothing and are not checked. */
static int local_memhs(EngineObject *e, const uint64_t *ops, size_t n, int pvm, ucp_mem_h *out)
{
    size_t hint = 0, bad = 0;
    int rc = 0;
    pthread_mutex_lock(&e->lock);
    for (size_t i = 0; i < n && rc == 0; i++) {
        ucs_memory_type_t t = UCS_MEMORY_TYPE_HOST;
        const uint64_t *op = ops + 4 * i;
        ucp_mem_h m = op[2] == 0 ? NULL : find_region(e, op[0], op[2], &hint, &t);
        if (op[2] != 0 && m == NULL) rc = -1;
        else if (pvm && m != NULL && t != UCS_MEMORY_TYPE_HOST) rc = -2;
        if (rc) bad = i;
        if (out) out[i] = m;
    }
    pthread_mutex_unlock(&e->lock);
    if (rc == -1)
        PyErr_Format(PyExc_ValueError,
                     "op %zu: local range [%#llx, +%llu) is outside every registered region", bad,
                     (unsigned long long)ops[4 * bad], (unsigned long long)ops[4 * bad + 2]);
    else if (rc == -2)
        PyErr_SetString(PyExc_ValueError, "same-host reads cannot land in device memory");
    return rc ? -1 : 0;
}

static PyObject *peer_get(PeerObject *self, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    EngineObject *e = self->eng;
    peer_t *p = self->p;
    ucp_mem_h *memhs = NULL;
    PyObject *res = NULL;
    if (view.itemsize != 8 || view.len % 32 != 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "ops must be a C-contiguous (n, 4) array of 8-byte ints");
        return NULL;
    }
    if (use_begin(e)) {
        PyBuffer_Release(&view);
        return NULL;
    }
    const uint64_t *ops = view.buf;
    size_t n = (size_t)view.len / 32;
    pthread_mutex_lock(&p->oplock);
    if (peer_usable(self) < 0 || validate_ops(p, ops, n) < 0) goto out;
    if (p->path == PATH_PVM) {
        if (local_memhs(e, ops, n, 1, NULL) < 0) goto out;
        xfer_t *x = NULL;
        int err = pvm_submit(e, p, ops, n, &x);
        if (err != 0) {
            PyErr_NoMemory();
            goto out;
        }
        res = (PyObject *)xfer_wrap(e, x);
        goto out;
    }
    memhs = malloc((n ? n : 1) * sizeof(*memhs));
    if (memhs == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    if (local_memhs(e, ops, n, 0, memhs) < 0) goto out;
    pthread_mutex_lock(&e->lock);
    xfer_t *x = xfer_new(e, XK_GET, p, 2); /* Python + flush callback */
    pthread_mutex_unlock(&e->lock);
    if (x == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    Py_BEGIN_ALLOW_THREADS
    ucx_post_gets(e, p, ops, n, memhs, x);
    Py_END_ALLOW_THREADS
    res = (PyObject *)xfer_wrap(e, x);
out:
    pthread_mutex_unlock(&p->oplock);
    use_end(e);
    free(memhs);
    PyBuffer_Release(&view);
    return res;
}

static PyObject *peer_request(PeerObject *self, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    EngineObject *e = self->eng;
    peer_t *p = self->p;
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
    if (use_begin(e)) {
        free(c);
        return NULL;
    }
    pthread_mutex_lock(&p->oplock);
    if (peer_usable(self) < 0) {
        pthread_mutex_unlock(&p->oplock);
        use_end(e);
        free(c);
        return NULL;
    }
    pthread_mutex_lock(&e->lock);
    /* Python + reply path (reply, peer error, send error or abort drops it). */
    xfer_t *x = xfer_new(e, XK_REQUEST, p, 2);
    if (x != NULL) x->req_id = random_req_id(e);
    pthread_mutex_unlock(&e->lock);
    if (x == NULL) {
        pthread_mutex_unlock(&p->oplock);
        use_end(e);
        free(c);
        return PyErr_NoMemory();
    }
    c->req_id = x->req_id;
    c->hdr.req.req_id = x->req_id;
    c->hdr.req.addr_len = (uint32_t)e->address_len;
    c->hdr.req.reserved = 0;
    ucs_status_t st;
    Py_BEGIN_ALLOW_THREADS
    /* The flag hands the receiver UCX's reply_ep, which we no longer use (see ucx_reply), but
     * engines built before that still answer over it. */
    st = post_am(e, p->ep, AM_ID_REQUEST, c, sizeof(req_hdr_t), UCP_AM_SEND_FLAG_REPLY);
    Py_END_ALLOW_THREADS
    pthread_mutex_unlock(&p->oplock);
    use_end(e);
    if (st != UCS_OK && st != UCS_INPROGRESS) {
        pthread_mutex_lock(&e->lock);
        xfer_finish(x, st, "request send");
        pthread_mutex_unlock(&e->lock);
    }
    return (PyObject *)xfer_wrap(e, x);
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

static PyObject *peer_get_data_error_handling(PeerObject *self, void *Py_UNUSED(closure))
{
    return PyUnicode_FromString(self->p->dep_err_handling ? "peer" : "none");
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
     "unpack_rkey(packed, base, length) -> index used in get() ops; get() rejects ops reading\n"
     "outside [base, base + length)."},
    {"get", (PyCFunction)peer_get, METH_O,
     "get(ops) -> Xfer: ucp_get_nbx per row (local, remote, nbytes, rkey), then ep flush;\n"
     "every local range must lie inside a region registered with this engine."},
    {"request", (PyCFunction)peer_request, METH_O, "request(payload) -> Xfer awaiting a reply."},
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
    {"data_error_handling", (getter)peer_get_data_error_handling, NULL,
     "the data ep's UCX error handling: 'peer', or 'none' where cma may carry GETs", NULL},
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

static int xfer_state_locked(XferObject *self)
{
    pthread_mutex_lock(&self->eng->lock);
    int s = self->x->state;
    pthread_mutex_unlock(&self->eng->lock);
    return s;
}

static PyObject *xfer_state(XferObject *self, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromLong(xfer_state_locked(self));
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
    if (xfer_state_locked(self) != XS_DONE) {
        PyErr_SetString(TransportError, "transfer is not done");
        return NULL;
    }
    /* reply/reply_len were written before the state turned DONE under eng->lock. */
    if (self->x->reply == NULL) return PyBytes_FromStringAndSize("", 0);
    return PyBytes_FromStringAndSize(self->x->reply, (Py_ssize_t)self->x->reply_len);
}

static PyObject *xfer_get_error(XferObject *self, void *Py_UNUSED(closure))
{
    if (xfer_state_locked(self) != XS_ERROR) Py_RETURN_NONE;
    return PyUnicode_FromString(self->x->err);
}

static PyObject *xfer_get_path(XferObject *self, void *Py_UNUSED(closure))
{
    if (self->x->kind != XK_GET) Py_RETURN_NONE;
    return PyUnicode_FromString(self->x->path == PATH_PVM ? "pvm" : "ucx");
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

static PyObject *mod_library(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(ignored))
{
    return PyUnicode_FromString(ucx_library_path());
}

static PyObject *mod_build_info(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(ignored))
{
    return Py_BuildValue("{s:s,s:s}", "ucx_source", PDSERVE_UCX_SOURCE, "header_api",
                         Py_STRINGIFY(UCP_API_MAJOR) "." Py_STRINGIFY(UCP_API_MINOR));
}

static PyMethodDef module_methods[] = {
    {"ucp_version", mod_version, METH_NOARGS, "version string of the libucp running now"},
    {"ucp_library", mod_library, METH_NOARGS, "path of the libucp running now"},
    {"build_info", mod_build_info, METH_NOARGS,
     "{'ucx_source': which UCX it was built against, 'header_api': UCP API of its headers}"},
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
