/*
 * fmha_rt C shim: the one declaration of its API.
 *
 * The Python binding's cffi cdef is read from the blocks between the CDEF markers below, so this file
 * is the single source of truth for the ABI between Python and C. Keep those blocks free of
 * preprocessor directives other than integer #defines (cffi parses them).
 *
 * Every function returns FMHA_OK (0) or an error code; after an error, fmha_last_error() gives a
 * thread-local message that names the driver call, the driver's error name, the kernel and the device.
 */
#ifndef FMHA_RT_H
#define FMHA_RT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* CDEF BEGIN */
#define FMHA_OK 0
#define FMHA_ERR_DRIVER 1        /* a driver call failed: see fmha_last_error() and fmha_last_driver_code() */
#define FMHA_ERR_NO_DRIVER 2     /* no CUDA or HIP runtime library could be loaded */
#define FMHA_ERR_NO_SYMBOL 3     /* the library lacks an entry point the shim needs */
#define FMHA_ERR_BAD_ARGUMENT 4  /* a bad ordinal, a NULL pointer, an unknown kernel handle */
#define FMHA_ERR_NOT_INITIALIZED 5
#define FMHA_ERR_OUT_OF_MEMORY 6 /* host allocation inside the shim failed */

#define FMHA_BACKEND_AUTO 0
#define FMHA_BACKEND_CUDA 1
#define FMHA_BACKEND_HIP 2

typedef struct fmha_device_info {
    int ordinal;
    char name[256];
    char arch[64];            /* "sm_90", or the bare gfx name with feature suffixes stripped: "gfx942" */
    char arch_full[128];      /* as the driver reports it, e.g. "gfx942:sramecc+:xnack-" */
    int multiprocessor_count;
    int max_shared_per_block_optin; /* bytes a block may use after raising its limit */
    uint64_t total_memory;    /* bytes */
} fmha_device_info;

/* One loaded kernel: an entry of the kernel map, keyed by (device ordinal, kernel key). */
typedef struct fmha_kernel fmha_kernel;

/* Load the driver library and initialise it. `backend` is FMHA_BACKEND_AUTO/CUDA/HIP. Idempotent: a
   second call returns the first call's result. `library_out` receives the soname that was loaded. */
int fmha_init(int backend, char *library_out, size_t library_len);
int fmha_backend(void);
int fmha_driver_version(int *version);
const char *fmha_last_error(void);
int fmha_last_driver_code(void);

int fmha_device_count(int *count);
int fmha_device_get_info(int ordinal, fmha_device_info *info);
/* The device that is current on the calling thread (the caller's state, which the shim restores). */
int fmha_current_device(int *ordinal);

/* Make `device` current on the calling thread until fmha_device_scope_leave, which restores what was
   current before. For calls into other libraries that act on the current device (a framework's
   DLPack export, say) on behalf of arrays that live on another device. */
typedef struct fmha_device_scope {
    void *context;
    int device;
    int restore;
} fmha_device_scope;
int fmha_device_scope_enter(int device, fmha_device_scope *scope);
int fmha_device_scope_leave(const fmha_device_scope *scope);

/* Find (device, key) in the kernel map, loading `image` on that device on first use. `symbol` is the
   entry point's name inside the image; `dynamic_shared_bytes` above 48 KiB raises the kernel's limit.
   Safe to call from many threads: the map is guarded by a mutex, loading happens outside it, and
   loads on one device take turns, so that racing threads load a kernel once per device. */
int fmha_kernel_get(int device, const char *key, const void *image, size_t image_size,
                    const char *symbol, unsigned int dynamic_shared_bytes, fmha_kernel **kernel);
/* Look up without loading: *kernel is NULL when (device, key) is not in the map. */
int fmha_kernel_find(int device, const char *key, fmha_kernel **kernel);
int fmha_kernel_map_size(size_t *count);
/* The i-th map entry's device and key, for inspection and tests. */
int fmha_kernel_map_entry(size_t index, int *device, char *key, size_t key_len);

/* Launch with a packed argument buffer through the launch `extra` path on `stream` (0: default). */
int fmha_launch(fmha_kernel *kernel, unsigned int grid_x, unsigned int grid_y, unsigned int grid_z,
                unsigned int block_x, unsigned int block_y, unsigned int block_z,
                unsigned int dynamic_shared_bytes, uint64_t stream, void *args, size_t args_size);

/* Everything one launch needs, prepared once so that a repeated launch passes only the stream. */
typedef struct fmha_launch_config {
    fmha_kernel *kernel;
    unsigned int grid[3];
    unsigned int block[3];
    unsigned int dynamic_shared_bytes;
    void *args;
    size_t args_size;
} fmha_launch_config;
int fmha_launch_prepared(const fmha_launch_config *config, uint64_t stream);

/* Stream-ordered device memory and copies, each on `device` with that device made current. */
int fmha_mem_alloc(int device, size_t bytes, uint64_t stream, uint64_t *ptr);
int fmha_mem_free(int device, uint64_t ptr, uint64_t stream);
int fmha_memset_d8(int device, uint64_t ptr, unsigned char value, size_t bytes, uint64_t stream);
int fmha_memcpy_htod(int device, uint64_t dst, const void *src, size_t bytes, uint64_t stream);
int fmha_memcpy_dtoh(int device, void *dst, uint64_t src, size_t bytes, uint64_t stream);
int fmha_stream_synchronize(int device, uint64_t stream);
/* The capture status of `stream` (0 none, 1 active, 2 invalidated: the driver's enum). FMHA_ERR_NO_SYMBOL
   when the driver lacks the query (callers then assume a capture). */
int fmha_stream_capture_status(int device, uint64_t stream, int *status);
/* Where the memory at `ptr` lives: its DLPack device type (2 CUDA, 10 ROCm), the ordinal of the device it
   was allocated on and the driver's memory type (kept as the driver says it; it only keys, never
   decides). An error when the driver knows no allocation there (CUDA's FMHA_ERR_BAD_ARGUMENT; HIP's own). */
int fmha_pointer_location(uint64_t ptr, int *device_type, int *device, int *memory_type);
/* Events for ordering one stream after another (no timing), on `device` with that device made current,
   so that the default-stream handles 0, 1 and 2 name that device's streams. */
int fmha_event_create(int device, uint64_t *event);
int fmha_event_record(int device, uint64_t event, uint64_t stream);
int fmha_stream_wait_event(int device, uint64_t stream, uint64_t event);
/* A CUDA graph of `count` kernel nodes, one per launch config, each after the one before (their grids,
   blocks and shared memory fixed; their arguments those of `launches` until set again), instantiated on
   `device`. FMHA_ERR_NO_SYMBOL where the driver has no graphs (HIP here: not implemented). */
int fmha_graph_create(int device, const fmha_launch_config *launches, size_t count, void **graph);
/* Set every node's arguments to those of `launches` (the configs it was created from, patched) and
   launch the graph on `stream`. *failed: the node whose arguments were refused, or 0 when the launch
   itself failed (the error then names every kernel of the graph). */
int fmha_graph_launch(void *graph, const fmha_launch_config *launches, size_t count, uint64_t stream,
                      size_t *failed);
/* Free a graph (launches still queued complete: the driver frees it after them). */
int fmha_graph_destroy(void *graph);

/* ---- replaying a cached call (fmha_rt/csrc/replay.c) ----
   A cached plan's launches with one call's values written in, checked and launched in one call. The
   call's values (array addresses, the workspace base, per-call scalars) come as one uint64 array;
   a patch writes value + addend into an 8-byte argument slot of one launch's template, after
   checking its alignment. Everything is checked before anything is written: the overlap bounds
   first (an output whose address less another array's lies strictly between low and high overlaps
   it), then every patch; only then are the zero fills set and the kernels launched, in order. With
   allocate_workspace the replay takes fmha_rt's own workspace (fmha_workspace_take, after the overlap
   checks: fmha_rt's own memory overlaps none of the caller's arrays), stores its address at
   values[workspace_value] and hands it back after the launches, whatever happened. The replay reads
   the values from a copy it takes first, so a call made from inside one of its launches may reuse the
   caller's array. */
#define FMHA_ERR_OVERLAP 7    /* *failed: the index of the overlap bound that matched */
#define FMHA_ERR_MISALIGNED 8 /* *failed: the index of the patch whose address is misaligned */
#define FMHA_REPLAY_FAILED_ALLOC 4294967295 /* *failed when allocating the workspace failed */

typedef struct fmha_replay_patch {
    uint32_t launch;     /* patches come sorted by launch */
    uint32_t arg_offset; /* byte offset of the 8-byte slot in the launch's arguments */
    uint32_t value;      /* index into the call's values */
    uint32_t align;      /* the address must be a multiple of this (1: any) */
    uint64_t addend;     /* added to the value (a workspace region's offset) */
} fmha_replay_patch;

typedef struct fmha_replay_overlap {
    uint32_t output, other; /* value indices */
    int64_t low, high;
} fmha_replay_overlap;

typedef struct fmha_replay_fill {
    uint32_t value; /* the base (the workspace's value index) */
    uint64_t offset, nbytes;
} fmha_replay_fill;

/* The driver calls a replay and the describer (below) make: the shim's own, or stand-ins where there
   is no GPU. */
typedef struct fmha_replay_ops {
    int (*launch)(const fmha_launch_config *config, uint64_t stream);
    int (*memset_d8)(int device, uint64_t ptr, unsigned char value, size_t bytes, uint64_t stream);
    int (*mem_alloc)(int device, size_t bytes, uint64_t stream, uint64_t *ptr);
    int (*mem_free)(int device, uint64_t ptr, uint64_t stream);
    int (*stream_capture_status)(int device, uint64_t stream, int *status);
    int (*pointer_location)(uint64_t ptr, int *device_type, int *device, int *memory_type);
    int (*event_create)(int device, uint64_t *event);
    int (*event_record)(int device, uint64_t event, uint64_t stream);
    int (*stream_wait_event)(int device, uint64_t stream, uint64_t event);
    /* Launch graphs (fmha_graph_create, fmha_graph_launch, fmha_graph_destroy); NULL: one by one. */
    int (*graph_create)(int device, const fmha_launch_config *launches, size_t count, void **graph);
    int (*graph_launch)(void *graph, const fmha_launch_config *launches, size_t count, uint64_t stream,
                        size_t *failed);
    int (*graph_destroy)(void *graph);
} fmha_replay_ops;

#define FMHA_REPLAY_MAX_ARGS 4096 /* bytes of one launch's arguments */
#define FMHA_REPLAY_MAX_VALUES 32 /* a call's values */

typedef struct fmha_replay_plan {
    int device;
    size_t launch_count;
    const fmha_launch_config *launches; /* their args: the template bytes */
    size_t patch_count;
    const fmha_replay_patch *patches;
    size_t overlap_count;
    const fmha_replay_overlap *overlaps;
    size_t fill_count;
    const fmha_replay_fill *fills;
    uint32_t workspace_value; /* the workspace's value index */
    uint64_t workspace_bytes;
    uint32_t value_count; /* entries of a call's values, at most FMHA_REPLAY_MAX_VALUES */
    uint64_t graph_id;    /* names the plan's launch graphs (launch_graphs.c), never reused; 0: none */
} fmha_replay_plan;

/* Run `plan` with `values` on `stream`. Returns FMHA_OK; FMHA_ERR_OVERLAP or FMHA_ERR_MISALIGNED with
   *failed naming the check (nothing was written); or what taking the workspace, a fill or a launch
   returned, with *failed FMHA_REPLAY_FAILED_ALLOC, the index of that fill, or fill_count plus the index
   of that launch. */
int fmha_replay(const fmha_replay_plan *plan, const fmha_replay_ops *ops, uint64_t *values, uint64_t stream,
                int allocate_workspace, size_t *failed);
/* The shim's own driver calls (fmha_launch_prepared, fmha_memset_d8, fmha_mem_alloc, fmha_mem_free,
   fmha_stream_capture_status, fmha_pointer_location, fmha_event_create, fmha_event_record,
   fmha_stream_wait_event, and on CUDA fmha_graph_create, fmha_graph_launch, fmha_graph_destroy). */
const fmha_replay_ops *fmha_replay_native_ops(void);

/* ---- fmha_rt's own workspace, kept per stream (fmha_rt/csrc/workspaces.c) ----
   The workspace a replay allocates itself comes from here: per (ops, device, stream) one buffer of the
   largest size taken so far, reused by the next call on that stream (stream order puts its fills and
   launches behind the previous call's). Sizes above FMHA_WORKSPACE_CACHE_MAX_BYTES, a stream being
   captured into a graph (the graph would keep an address the cache may free later), a buffer another
   call holds right now (the two calls' enqueues could interleave) and streams beyond the first
   FMHA_WORKSPACE_CACHE_STREAMS get a buffer of their own, allocated now and freed when handed back.
   Growing frees the old buffer on the stream (after the calls queued there) before allocating. */
#define FMHA_WORKSPACE_CACHE_MAX_BYTES 67108864 /* 64 MiB */
#define FMHA_WORKSPACE_CACHE_STREAMS 64
typedef struct fmha_workspace_lease {
    uint64_t ptr;     /* the workspace */
    void *slot;       /* the cache entry it belongs to; NULL: a buffer of its own */
} fmha_workspace_lease;
/* A workspace of at least `bytes` on `device` for work queued on `stream`, until fmha_workspace_give;
   `capturing`: the stream is being captured (fmha_stream_capturing), so the buffer is the call's own. */
int fmha_workspace_take(const fmha_replay_ops *ops, int device, uint64_t stream, uint64_t bytes, int capturing,
                        fmha_workspace_lease *lease);
/* Hand a workspace back once the work that uses it is queued on the stream it was taken for. */
void fmha_workspace_give(const fmha_replay_ops *ops, int device, uint64_t stream, const fmha_workspace_lease *lease);
/* Free every kept buffer on its stream (stream-ordered; the streams must still exist); a buffer a call
   holds is freed when that call hands it back. Returns FMHA_OK or the first failed free's status. */
int fmha_workspaces_release(void);
/* How many buffers are kept and their bytes (a held one included). */
int fmha_workspaces_kept(size_t *count, uint64_t *bytes);

/* Whether `stream` is being captured into a graph (what it queues must not outlive the call, and is
   launched one by one). The null stream is never captured (both drivers refuse to begin a capture on
   it, and HIP refuses the query), so it needs no driver call; a failed query counts as a capture. */
int fmha_stream_capturing(const fmha_replay_ops *ops, int device, uint64_t stream);

/* ---- launch graphs of cached calls (fmha_rt/csrc/launch_graphs.c) ----
   A replay launches its plan's kernels as one graph whose nodes' arguments it sets per call: on an
   H200 host one driver launch costs ~3.7 us, setting two nodes and launching them as a graph ~2.5-3.2
   (NOTES.md, host v10). Per (ops, plan graph_id, device, stream) one graph is kept, made on the plan's
   first replay on that stream: launches of one graph are ordered after its earlier launches whatever
   their stream, so graphs are not shared between streams. The replay launches one by one instead for
   plans with graph_id 0 or more than FMHA_LAUNCH_GRAPH_MAX_NODES launches, while the stream is being
   captured, while another call holds the stream's graph of that plan, when the ops have no graphs or
   making one failed. FMHA_LAUNCH_GRAPH_SLOTS graphs at most, the least recently used one freed for a
   new one. */
#define FMHA_LAUNCH_GRAPH_SLOTS 64
#define FMHA_LAUNCH_GRAPH_MAX_NODES 4
/* Launch `launches` (the plan's, with this call's arguments) as the kept graph of (ops, plan, stream);
   `capturing` as for fmha_workspace_take. *taken 0: nothing was launched (FMHA_OK returned), launch
   them one by one. Else FMHA_OK, or what a graph call returned with *failed the index of the launch it
   names. */
int fmha_launch_graph_run(const fmha_replay_ops *ops, const fmha_replay_plan *plan, const fmha_launch_config *launches,
                          uint64_t stream, int capturing, int *taken, size_t *failed);
/* Free every kept graph (one a call holds when that call is done with it). Returns FMHA_OK or the first
   failed free's status. */
int fmha_launch_graphs_release(void);
/* How many graphs are kept (a held one and those whose making failed included). */
int fmha_launch_graphs_kept(size_t *count);

/* ---- ordering a call's stream after an array's producer (fmha_rt/csrc/events.c) ----
   fmha_stream_order makes `consumer` wait for the work queued so far on `producer`, both streams of
   `device`, without a host synchronization: it records an event on the producer and has the consumer
   wait on it. Events (without timing) are created on first need and kept in a pool of
   FMHA_EVENT_POOL slots, each belonging to one (ops, device); a call holds one event from its record
   to its wait, after which the event may be recorded again (a queued wait keeps the state it saw).
   FMHA_ERR_OUT_OF_MEMORY when every slot is held; what an event call returned when it failed. */
#define FMHA_EVENT_POOL 64
int fmha_stream_order(const fmha_replay_ops *ops, int device, uint64_t producer, uint64_t consumer);
/* How many events the pool keeps for `ops` (held ones included). */
int fmha_events_kept(const fmha_replay_ops *ops, size_t *count);

/* ---- describing a call's arrays for the plan cache (fmha_rt/csrc/describe.c) ----
   One C call describes every array of a call: torch tensors through the framework's DLPack C exchange
   API (`type(tensor).__dlpack_c_exchange_api__`, DLPack >= 1.3), other arrays through their CUDA Array
   Interface (`__cuda_array_interface__`, version 3), instead of Python attribute reads or a DLPack
   round trip. Python objects travel as their addresses (CPython's id()). The describing itself is a
   Python builtin that fmha_describer_init makes:
       describe(objects, addresses, capacity, stream) -> bytes or None
   describes the tuple `objects` (at most FMHA_DESCRIBE_MAX_ARRAYS items, each None, a tensor of one of
   the describer's types or an array with the interface): per item its kind (1 torch, 2 interface, 3 CuPy),
   dtype, rank, device type and ordinal, shape and strides in elements, and for the interface its
   memory type, read-only flag and Python type (kept alive from then on, so that its address stays
   unique); never an address. Equal bytes mean equal signatures. It writes the items' data addresses
   (0 for None) to the uint64 array at the int `addresses` and zeroes the rest of its `capacity`
   entries (the per-call values that follow them).
   An interface array's device is the driver's answer for its pointer (ops->pointer_location, one
   query per distinct pointer and call). A CuPy array (exactly the describer's cupy type) is read from
   its attributes instead (shape, strides, dtype kind and itemsize, data.ptr, data.device_id: its
   device is CuPy's word, no memory type is keyed), and only the call's first CuPy array's interface
   is made, for its stream entry, which CuPy fills alike for every array (its current stream). An
   interface's `stream` entry is CAI v3's: absent or None, the data is ready on every stream; an int is the producer's stream (1 the legacy default stream, 2 the
   per-thread default stream, 0 invalid); when it is not the call's `stream` (the call's 0 is the legacy
   default stream, which on CUDA is also the driver's 1 and on ROCm its null stream, 0), the call's
   stream is made to wait for it (fmha_stream_order), once per (device, producer stream), after every
   item was described.
   It returns None, leaving no Python error set and having ordered nothing, when an item cannot be
   described exactly: another type; a torch tensor of rank above FMHA_DESCRIBE_MAX_NDIM, negated or
   failing its export; an interface of another version (version 2 says nothing about streams: DLPack
   asks such producers to order their work instead), with a mask, a typestr other than a little-endian
   float (f2 f4 f8), signed or unsigned int (1, 2, 4, 8 bytes) or bool, negative strides or strides
   that are not whole elements, a stream of 0 or not an int, a pointer the driver does not know, or
   anything malformed; a failed stream ordering. The caller then describes the call another way. */
#define FMHA_DESCRIBE_MAX_NDIM 8
#define FMHA_DESCRIBE_MAX_ARRAYS 16
#define FMHA_DESCRIBE_WORDS_PER_ARRAY 20 /* 4 + 2 * FMHA_DESCRIBE_MAX_NDIM */
#define FMHA_DESCRIBE_MAX_TYPES 16       /* Python types of interface arrays kept alive */
typedef struct fmha_describer {
    const fmha_replay_ops *ops; /* the driver calls for pointers and stream ordering */
    uintptr_t types[2];      /* torch.Tensor and torch.nn.Parameter; 0: none */
    uintptr_t export_fn;     /* the framework's DLPackDLTensorFromPyObjectNoSync; 0: its tensors are refused */
    uintptr_t is_neg;        /* the first type's unbound method that says a tensor holds negated values */
    uintptr_t cupy_type;     /* cupy.ndarray, described from its attributes; 0: none */
    int cupy_device_type;    /* its arrays' DLPack device type (2 CUDA, 10 ROCm: the shim's backend) */
} fmha_describer;
/* Fill `d` from `ops`, the two tensor types (0 for an unused one; both 0 when torch is not imported)
   and CuPy's array type (0 when cupy is not imported) and store the builtin `describe`, bound to a copy
   of `d`, in the dict at `namespace`. A first type without a usable exchange API (an older torch)
   leaves export_fn 0: tensors of the two types are then refused (callers describe them another way)
   and interface arrays described as ever. */
int fmha_describer_init(fmha_describer *d, const fmha_replay_ops *ops, uintptr_t tensor_type, uintptr_t second_type,
                        uintptr_t cupy_type, int cupy_device_type, uintptr_t namespace);

/* ---- launch programs (fmha_rt/csrc/program.c) ----
   A call's launches in the wire format of fmha_rt/replay/program.py, loaded into a replay plan: the
   plan cache loads one per recorded signature, the XLA handler one per call. fmha_program_load decodes
   and checks `words` (into a copy of its own); on failure *out is NULL and `why` says what is wrong.
   fmha_program_bind then makes its plan run on `device`: `kernels` gives each launch's kernel handle,
   in launch order, or NULL takes the kernels of the images registered in the shim
   (fmha_image_register); `graph_id` becomes the plan's (0: no launch graph). On failure `why` names
   the kernel. */
typedef struct fmha_program fmha_program;
int fmha_program_load(const int64_t *words, size_t count, fmha_program **out, char *why, size_t why_size);
int fmha_program_bind(fmha_program *program, int device, fmha_kernel **kernels, uint64_t graph_id, char *why,
                      size_t why_size);
/* The replay plan of a loaded program (fmha_replay runs it); it lives as long as the program. */
const fmha_replay_plan *fmha_program_plan(const fmha_program *program);
void fmha_program_free(fmha_program *program);

/* Unload every module of the kernel map (at exit). */
int fmha_unload_all(void);

/* Kernel images kept inside the shim, for launchers that run where Python cannot be asked (the XLA FFI
   handler below): `key` -> a private copy of `image`, its entry point `symbol` and the dynamic shared
   memory its launches use. The copy lives as long as the process. Registering a key again with the
   same bytes does nothing; with different bytes it fails: one key names one image. Thread-safe. */
int fmha_image_register(const char *key, const void *image, size_t image_size, const char *symbol,
                        unsigned int dynamic_shared_bytes);
/* The kernel `key` on `device`: from the kernel map, or loaded into it from the registered image. */
int fmha_image_kernel(int device, const char *key, fmha_kernel **kernel);
int fmha_image_count(size_t *count);
/* CDEF END */

/* The XLA FFI handler (fmha_rt/csrc/xla_ffi.c). It is compiled in only when the build found XLA's C FFI
   header (jaxlib's include folder); the cffi cdef takes this block only then, so Python sees these
   names exactly when they exist.
   fmha_xla_run_program runs the launch program in the call's `program` attribute (an int64 array in
   the format of fmha_rt/replay/program.py, loaded by fmha_program_load) on XLA's stream and device: it
   checks the call's buffers against the program and runs its replay (fmha_replay) with their
   addresses as the values. It never calls into Python. */
/* CDEF XLA_FFI BEGIN */
struct XLA_FFI_Error;
struct XLA_FFI_CallFrame;
struct XLA_FFI_Error *fmha_xla_run_program(struct XLA_FFI_CallFrame *frame);
/* The version of XLA's FFI C API the handler was compiled against. */
void fmha_xla_ffi_api_version(int *major, int *minor);
/* CDEF XLA_FFI END */

#ifdef __cplusplus
}
#endif
#endif /* FMHA_RT_H */
