/*
 * _ucxrma: one-sided UCX (libucp) transport for pdserve's KV pulls.  Shared declarations.
 *
 * Files
 *   ucxrma.h   this header: objects, wire formats, options, cross-file functions.
 *   ucx_core.c UCX: context/worker set-up and teardown, the progress thread, callbacks, memory
 *              registration (host or CUDA memory), GETs and active messages, endpoint close,
 *              what this libucp is and which transports it sees.
 *   pvm.c      the same-host read path: locality and nonce, process_vm_readv worker threads,
 *              huge-page advice for host regions.
 *   module.c   the Python types (Engine, Peer, Xfer) and the module.
 *
 * One UCP context + one worker (UCS_THREAD_MODE_MULTI) per Engine, progressed by a native pthread
 * that polls for `spin_us` after the last event, then sleeps on the worker's event fd
 * (ucp_worker_arm + poll) or, with wakeup off, backs off with short sleeps.  Python never runs on
 * that thread: UCX callbacks only touch plain C state guarded by Engine.lock, and signal
 * Engine.cond.
 *
 * Objects and lifetimes
 *   Engine  owns context, worker, memory handles, the progress thread, the incoming-request queue
 *           and the list of pending transfers.  All C state lives inside the Python object, so
 *           anything holding a strong reference to the Engine may use its lock after close().
 *   Peer    (Python object) owns a refcounted peer_t: two eps to the same remote worker and the
 *           rkeys unpacked on the data ep.  The control ep (UCP_ERR_HANDLING_MODE_PEER) carries
 *           requests and replies and detects the peer's failure; its error callback's argument
 *           is the peer_t, which is freed only after the eps are closed.  The data ep carries
 *           GETs.  Toward a peer on this kernel boot it has no UCX error handling, because
 *           peer error handling keeps UCX off cma (GETs then fall back to software emulation
 *           over tcp, ~3x slower here), and a dead cma peer only fails the read (ESRCH); a
 *           control-ep failure fails the peer's GETs.  Toward other hosts (or an unknown
 *           locality) the data ep keeps peer error handling: there it costs no lane, and a
 *           network transport's error without it may abort the process (seen on IB).
 *   Xfer    (Python object) owns a reference to a refcounted xfer_t; UCX callbacks hold another.
 *   reply peers  a peer_t without a Python object (is_reply, control ep only, listed in
 *           Engine.peers, the list's reference only), one per requester address, at most
 *           REPLY_PEERS_MAX (least recently used closed first).  Replies go over them, never
 *           over the reply_ep UCX hands to a request's callback: UCX destroys that ep when the
 *           requester fails (it is not exposed to us), so a pointer kept past the callback may
 *           name freed memory (security review finding 17).  ucp_ep_create to the requester's
 *           address may pair with the requester's own ep to us (UCX's connection matching), else
 *           it connects anew; either way the ep is ours until we close it: a dead requester fails
 *           our send through the error callback instead.  A reply peer is created only for a
 *           reply the caller vouches for (the requester proved a lease): others are sent only
 *           over a live one we hold, or dropped, so a request cannot make us connect to an
 *           address it merely names (security review finding 15).
 *
 * Threads and locks (nothing relies on the GIL to guard C state)
 *   Engine.uselock (rwlock)  every call that uses the worker or context (register, connect,
 *                            get, request, reply) holds it shared and checks `closed`; close()
 *                            sets `closed` under it exclusively, so once close() proceeds no
 *                            such call is running or can start.
 *   peer_t.oplock            serialises every use of the ep against closing it.
 *   Engine.replylock         serialises replies: finding, creating and evicting reply peers.
 *   Engine.lock              transfers, queues, counters, regions, pvm jobs, the peer list and
 *                            peer_t.failed; UCX callbacks take it, so never call into UCX while
 *                            holding it.
 *   Order: uselock -> replylock -> oplock -> Engine.lock.  `stop`, `closed` are also atomics so
 *   the progress thread and getters may read them without a lock.
 *
 * Local memory: every get's destination must lie inside one registered region (UCX and pvm
 * paths alike), and every rkey is unpacked with the remote region's base and length, which
 * every get is checked against: a bad block id is refused, never written or read elsewhere.
 *
 * Same-host path ("pvm")
 *   Engine.locality advertises (boot id, pid-namespace, pid, address of a 16-byte random nonce
 *   inside the Engine, the nonce).  connect(address, locality) on the same host and pid namespace
 *   probes the peer with process_vm_readv(2) of that nonce: if it reads back the same bytes the
 *   peer's gets bypass UCX and run as process_vm_readv iovec batches on native "pvm" worker
 *   threads; otherwise (EPERM, ENOSYS, ESRCH, mismatch) the peer stays on UCX and
 *   Peer.path_reason says why.  After the last batch of a get the nonce is read again, so a get
 *   only succeeds if every byte came from the same live peer engine (not from a process that
 *   reused its pid after it died, nor after it closed its engine: close() wipes the nonce).
 *   Jobs are split into batches of at most IOV_MAX segments / pvm_chunk bytes; a peer counts its
 *   in-flight batches (peer_t.pvm_inflight, under Engine.lock) and peer_close() cancels queued
 *   batches and waits for in-flight ones, so after abort() no byte can still land.
 *   The exporting engine calls prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY) so that Yama
 *   (ptrace_scope=1) lets same-uid non-ancestor processes read it.  Option same_host=0 turns
 *   all of this off (no prctl, empty locality, connect() ignores localities).  The path only
 *   reads host memory: an engine that registered device (CUDA) memory advertises no locality
 *   and reads its peers over UCX.
 */
#ifndef PDSERVE_UCXRMA_H
#define PDSERVE_UCXRMA_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ucp/api/ucp.h>

#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

#define AM_ID_REQUEST 0x5044 /* 'PD' */
#define AM_ID_REPLY   0x5045

enum { XS_PENDING = 0, XS_DONE = 1, XS_ERROR = 2 };
enum { XK_GET = 0, XK_REQUEST = 1, XK_CLOSE = 2 };
enum { PATH_UCX = 0, PATH_PVM = 1 };
enum { THP_OFF = 0, THP_ADVISE = 1, THP_COLLAPSE = 2 };

/* UCX's switch for GETs over CUDA IPC; see ucx_engine_open. */
#define CUDA_IPC_GET_ENV "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
#define NONCE_LEN 16
#define LOC_MAGIC "PDSLOC1"

/* Requests (release / renew messages) queued for Python at most: beyond, they are dropped and
 * counted in dropped_am (a peer's flood must not grow the prefill's memory). */
#define IN_QUEUE_MAX 16384

/* Requesters we keep a reply endpoint to; beyond, the least recently used one is closed. */
#define REPLY_PEERS_MAX 1024

/* A sender address longer than this is refused (UCX worker addresses are a few hundred bytes). */
#define SENDER_ADDR_MAX 65536

/* Knobs, given to Engine(...) by the Python layer (from ConnectorConfig); never read from the
 * environment here.  UCX's own UCX_* variables still apply through ucp_config_read. */
typedef struct {
    int same_host;        /* advertise a locality and read same-host peers with pvm */
    int pvm_threads;      /* pvm worker threads; 0: 2 when 2+ CPUs are usable, else 1 */
    size_t pvm_chunk;     /* bytes per pvm batch */
    int thp;              /* THP_OFF / THP_ADVISE / THP_COLLAPSE for registered host memory */
    int wakeup;           /* sleep on the worker's event fd (UCP_FEATURE_WAKEUP) when idle */
    double spin_us;       /* keep polling this long after the last event before sleeping */
} ucxrma_opts_t;

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
    ucp_ep_h ep;               /* control: requests/replies, peer-failure detection */
    ucp_ep_h dep;              /* data: GETs (see ucx_ep_create for its error handling); NULL
                                  for a reply peer */
    int same_boot;             /* the peer's locality shows this kernel boot (fixed at connect) */
    int same_pidns;            /* ... and our pid namespace (cma can name its pid) */
    int dep_err_handling;      /* the data ep has UCX peer error handling (fixed at connect) */
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
    /* reply peers only (fixed at creation, except last_used: eng->lock) */
    int is_reply;
    char *raddr;               /* the requester's worker address */
    size_t raddr_len;
    uint64_t last_used;
};

typedef struct inreq {
    struct inreq *next;
    uint64_t req_id;
    size_t addr_len, payload_len;
    char data[];               /* sender address, then payload */
} inreq_t;

typedef struct {
    ucp_mem_h memh;
    uintptr_t addr;
    size_t length;
    ucs_memory_type_t mem_type;
} region_t;

struct EngineObject {
    PyObject_HEAD
    ucxrma_opts_t opt;
    ucp_context_h ctx;
    ucp_worker_h worker;
    int efd;
    pthread_t thread;
    int thread_started;
    int stop;                  /* atomic */
    int closed;                /* atomic; set under uselock (exclusive) */
    int shutdown_claimed;      /* atomic: exactly one close() tears down */
    pthread_rwlock_t uselock;
    pthread_mutex_t replylock;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int sync_ok;
    inreq_t *in_head, *in_tail;
    size_t in_count;           /* at most IN_QUEUE_MAX: more requests are dropped, counted */
    xfer_t *pending;
    peer_t *peers;
    uint64_t next_req_id;
    region_t *regions;         /* eng->lock */
    size_t nregions, capregions;
    int device_regions;        /* eng->lock: regions that are not host memory */
    char *address;
    size_t address_len;
    uint64_t dropped_am;
    uint64_t failed_replies;
    uint64_t unanswered_strangers; /* eng->lock: replies not sent: no reply peer for the
                                      requester and the request was not vouched for */
    uint64_t reply_clock;      /* eng->lock: orders reply peers by last use */
    /* same-host path */
    volatile uint8_t nonce[NONCE_LEN]; /* read by peers through process_vm_readv */
    locality_t self_loc;
    int have_loc;              /* self_loc is valid and advertised (atomic: cleared on device
                                  registration) */
    int loc_known;             /* boot id / pidns readable (to compare peers' localities) */
    int has_cma;               /* cma is among this context's resources (UCX_TLS allows it) */
    pthread_cond_t pvm_cond;   /* workers wait here for jobs (with eng->lock) */
    xfer_t *pvm_head, *pvm_tail;
    pthread_t *pvm_threads;
    int pvm_nthreads, pvm_started, pvm_stop; /* eng->lock */
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

/* ---------------------------------------------------------------- ucx_core.c */
void deadline_from_now(struct timespec *ts, double timeout_s);
/* Transfers: all expect eng->lock held unless stated. */
xfer_t *xfer_new(EngineObject *e, int kind, peer_t *p, int refs);
void xfer_finish(xfer_t *x, ucs_status_t st, const char *why);
void xfer_fail_msg(xfer_t *x, ucs_status_t st, const char *msg);
void xfer_unref(xfer_t *x);
void xfer_unref_locked(xfer_t *x); /* takes eng->lock */
int wait_xfer(xfer_t *x, double timeout_s); /* takes eng->lock */
void wake(EngineObject *e);
/* Engine: 0 or a UCX status with `what` naming the failing call. */
ucs_status_t ucx_engine_open(EngineObject *e, const char *name, const char **what);
void ucx_close_peers(EngineObject *e);
void ucx_stop_progress(EngineObject *e);
void ucx_engine_release(EngineObject *e);
ucs_status_t ucx_register(EngineObject *e, uintptr_t addr, size_t length, int want_type,
                          region_t *out, void **rkey, size_t *rkey_len, const char **what);
ucp_mem_h find_region(EngineObject *e, uintptr_t addr, size_t len, size_t *hint,
                      ucs_memory_type_t *mem_type); /* eng->lock held */
ucs_status_t ucx_post_gets(EngineObject *e, peer_t *p, const uint64_t *ops, size_t n,
                           ucp_mem_h *memhs, xfer_t *x);
ucs_status_t post_am(EngineObject *e, ucp_ep_h ep, unsigned id, send_ctx_t *c, size_t hdr_len,
                     uint32_t flags);
ucs_status_t ucx_ep_create(EngineObject *e, peer_t *p, const void *address);
/* Send a reply (GIL released, uselock held) over our reply peer for `addr`; c is freed here or
 * by am_send_cb.  A failure is counted in failed_replies; `what` names it.  Unless `vouched`
 * (the responder saw the requester prove a lease), only a live reply peer we already hold is
 * used: no endpoint is created, and a reply without one is dropped (UCS_OK, *stranger set,
 * counted in unanswered_strangers). */
ucs_status_t ucx_reply(EngineObject *e, const void *addr, size_t addr_len, int vouched,
                       send_ctx_t *c, int *stranger, const char **what);
int peer_close(peer_t *p, double timeout_s);
void peer_unref(peer_t *p);
void peer_detach_locked(peer_t *p);
char *ucx_context_info(EngineObject *e); /* malloc'd text of ucp_context_print_info */
uint64_t ucx_memory_types(EngineObject *e);
const char *ucx_library_path(void);

/* --------------------------------------------------------------------- pvm.c */
void pvm_init_locality(EngineObject *e);
void pvm_wipe_nonce(EngineObject *e);
void pvm_choose_path(EngineObject *e, peer_t *p, const char *loc, size_t len);
int pvm_submit(EngineObject *e, peer_t *p, const uint64_t *ops, size_t n, xfer_t **out);
int pvm_drain_peer(peer_t *p, double timeout_s);
void pvm_stop_all(EngineObject *e);
void advise_hugepages(int thp, uintptr_t addr, size_t length);

#endif
