/*
 * fmha_rt C shim: loads the GPU driver at run time (CUDA driver API or HIP), keeps the kernel map keyed
 * by (device ordinal, kernel key) under a mutex, and launches packed argument buffers on the caller's
 * stream. API and error codes: include/fmha_rt.h.
 *
 * There is no link-time dependency on either vendor: both are dlopen'ed and the few entry points used
 * are resolved into one table. The two drivers' signatures agree closely enough that one table of
 * loosely typed function pointers serves both; where they differ (contexts, attribute numbers, the
 * launch `extra` end marker) the code branches on `g.backend`.
 */
#include "fmha_rt.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int drv_result;       /* CUresult / hipError_t: 0 is success for both */
typedef void *drv_handle;     /* CUcontext, CUmodule, CUfunction, hipModule_t, hipFunction_t */

/* Launch `extra` array keys: equal for both vendors; the end marker differs (CUDA 0, HIP 3). */
#define LAUNCH_PARAM_BUFFER_POINTER ((void *)0x01)
#define LAUNCH_PARAM_BUFFER_SIZE ((void *)0x02)
#define CUDA_LAUNCH_PARAM_END ((void *)0x00)
#define HIP_LAUNCH_PARAM_END ((void *)0x03)

/* Codes both drivers return from init on a machine without a usable device: CUDA_ERROR_NO_DEVICE /
   hipErrorNoDevice (100), and CUDA_ERROR_INVALID_DEVICE / hipErrorInvalidDevice (101), which HIP gives
   when no GPU driver node exists. Either means "zero devices", not a failure. */
#define DRV_ERROR_NO_DEVICE 100
#define DRV_ERROR_INVALID_DEVICE 101

/* Device attributes: the numbers differ between the vendors. */
#define CU_ATTR_MULTIPROCESSOR_COUNT 16
#define CU_ATTR_CC_MAJOR 75
#define CU_ATTR_CC_MINOR 76
#define CU_ATTR_MAX_SHARED_PER_BLOCK_OPTIN 97
#define HIP_ATTR_MULTIPROCESSOR_COUNT 63
#define HIP_ATTR_SHARED_PER_BLOCK_OPTIN 75
#define CU_FUNC_ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES 8

/* Pointer attributes (CUDA) and the event flag both drivers number alike. */
#define CU_POINTER_ATTRIBUTE_MEMORY_TYPE 2
#define CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL 9
#define EVENT_DISABLE_TIMING 2
#define DLPACK_CUDA 2
#define DLPACK_ROCM 10

#define DEFAULT_SHARED_LIMIT (48u * 1024u)
#define MAX_DEVICES 64
#define KEY_LEN 160

struct driver {
    drv_result (*init)(unsigned int);
    drv_result (*driver_get_version)(int *);
    drv_result (*get_error_name)(drv_result, const char **);      /* CUDA only */
    const char *(*hip_error_name)(drv_result);                    /* HIP only: returns the name */
    drv_result (*device_get_count)(int *);
    drv_result (*device_get)(int *, int);                         /* CUDA only */
    drv_result (*device_get_name)(char *, int, int);
    drv_result (*device_get_attribute)(int *, int, int);
    drv_result (*device_total_mem)(size_t *, int);
    drv_result (*primary_ctx_retain)(drv_handle *, int);          /* CUDA only */
    drv_result (*ctx_get_current)(drv_handle *);                  /* CUDA only */
    drv_result (*ctx_set_current)(drv_handle);                    /* CUDA only */
    drv_result (*ctx_get_device)(int *);                          /* CUDA only */
    drv_result (*get_device)(int *);                              /* HIP only */
    drv_result (*set_device)(int);                                /* HIP only */
    drv_result (*get_device_properties)(void *, int);             /* HIP only */
    drv_result (*module_load_data)(drv_handle *, const void *);
    drv_result (*module_get_function)(drv_handle *, drv_handle, const char *);
    drv_result (*module_unload)(drv_handle);
    drv_result (*func_set_attribute)(drv_handle, int, int);       /* CUDA only */
    drv_result (*launch_kernel)(drv_handle, unsigned, unsigned, unsigned, unsigned, unsigned,
                                unsigned, unsigned, uint64_t, void **, void **);
    drv_result (*mem_alloc_async)(uint64_t *, size_t, uint64_t);
    drv_result (*mem_free_async)(uint64_t, uint64_t);
    drv_result (*memset_d8_async)(uint64_t, unsigned char, size_t, uint64_t);
    drv_result (*memcpy_htod_async)(uint64_t, const void *, size_t, uint64_t);
    drv_result (*memcpy_dtoh_async)(void *, uint64_t, size_t, uint64_t);
    drv_result (*stream_synchronize)(uint64_t);
    drv_result (*stream_is_capturing)(uint64_t, int *);           /* optional: without it, assume a capture */
    drv_result (*pointer_get_attributes)(unsigned, const int *, void **, uint64_t); /* CUDA only */
    drv_result (*hip_pointer_get_attributes)(void *, uint64_t);   /* HIP only */
    drv_result (*hip_get_last_error)(void);                       /* HIP only: reads and clears it */
    drv_result (*event_create)(uint64_t *, unsigned);
    drv_result (*event_record)(uint64_t, uint64_t);
    drv_result (*stream_wait_event)(uint64_t, uint64_t, unsigned);
    /* Graphs (CUDA only, optional: without them a replay launches one by one). */
    drv_result (*graph_create)(drv_handle *, unsigned);
    drv_result (*graph_add_kernel_node)(drv_handle *, drv_handle, const drv_handle *, size_t, const void *);
    drv_result (*graph_instantiate)(drv_handle *, drv_handle, unsigned long long);
    drv_result (*graph_exec_kernel_node_set_params)(drv_handle, drv_handle, const void *);
    drv_result (*graph_launch)(drv_handle, uint64_t);
    drv_result (*graph_exec_destroy)(drv_handle);
    drv_result (*graph_destroy)(drv_handle);
};

struct fmha_kernel {
    int device;
    char key[KEY_LEN];
    drv_handle module;
    drv_handle function;
    unsigned int shared_limit; /* dynamic shared memory the kernel is allowed, in bytes */
};

static struct {
    pthread_mutex_t init_lock;
    int init_done;
    int init_status;
    char init_error[1024];
    char library[64];
    int backend;
    void *lib;
    struct driver d;
    int device_count;
    drv_handle contexts[MAX_DEVICES]; /* CUDA primary contexts, retained once each */

    pthread_mutex_t map_lock;
    fmha_kernel **map;
    size_t map_len, map_cap;
    pthread_mutex_t load_locks[MAX_DEVICES]; /* one load at a time per device (fmha_kernel_get) */
} g = {PTHREAD_MUTEX_INITIALIZER, 0, 0, "", "", 0, NULL, {0}, 0, {0},
       PTHREAD_MUTEX_INITIALIZER, NULL, 0, 0, {PTHREAD_MUTEX_INITIALIZER}};

static __thread char t_error[1024];
static __thread int t_driver_code;

static int set_error(int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t_error, sizeof t_error, fmt, ap);
    va_end(ap);
    return status;
}

static const char *driver_error_name(drv_result r) {
    const char *name = NULL;
    if (g.d.hip_error_name) name = g.d.hip_error_name(r);
    else if (g.d.get_error_name && g.d.get_error_name(r, &name) != 0) name = NULL;
    return name ? name : "unknown driver error";
}

/* Record a failed driver call. The message names the call, the driver's error, kernel and device;
   Python parses nothing from it except for display: the structured fields travel separately. */
static int driver_error(drv_result r, const char *call, const char *kernel, int device) {
    t_driver_code = r;
    return set_error(FMHA_ERR_DRIVER, "%s failed with %s (%d) for kernel '%s' on device %d", call,
                     driver_error_name(r), r, kernel ? kernel : "-", device);
}

const char *fmha_last_error(void) { return t_error; }
int fmha_last_driver_code(void) { return t_driver_code; }
int fmha_backend(void) { return g.init_done && g.init_status == FMHA_OK ? g.backend : 0; }

#define RESOLVE(field, cuda_name, hip_name, required)                                             \
    do {                                                                                          \
        const char *sym_ = g.backend == FMHA_BACKEND_CUDA ? (cuda_name) : (hip_name);             \
        *(void **)&g.d.field = sym_ ? dlsym(g.lib, sym_) : NULL;                                  \
        if ((required) && sym_ && g.d.field == NULL)                                              \
            return set_error(FMHA_ERR_NO_SYMBOL, "%s has no entry point %s", g.library, sym_);    \
    } while (0)

static int resolve_entry_points(void) {
    int cuda = g.backend == FMHA_BACKEND_CUDA;
    RESOLVE(init, "cuInit", "hipInit", 1);
    RESOLVE(driver_get_version, "cuDriverGetVersion", "hipDriverGetVersion", 1);
    RESOLVE(get_error_name, "cuGetErrorName", NULL, 0);
    RESOLVE(hip_error_name, NULL, "hipGetErrorName", 0);
    RESOLVE(hip_get_last_error, NULL, "hipGetLastError", 1);
    RESOLVE(device_get_count, "cuDeviceGetCount", "hipGetDeviceCount", 1);
    RESOLVE(device_get, "cuDeviceGet", NULL, 1);
    RESOLVE(device_get_name, "cuDeviceGetName", "hipDeviceGetName", 1);
    RESOLVE(device_get_attribute, "cuDeviceGetAttribute", "hipDeviceGetAttribute", 1);
    RESOLVE(device_total_mem, "cuDeviceTotalMem_v2", "hipDeviceTotalMem", 1);
    RESOLVE(pointer_get_attributes, "cuPointerGetAttributes", NULL, 1);
    RESOLVE(hip_pointer_get_attributes, NULL, "hipPointerGetAttributes", 1);
    RESOLVE(primary_ctx_retain, "cuDevicePrimaryCtxRetain", NULL, 1);
    RESOLVE(ctx_get_current, "cuCtxGetCurrent", NULL, 1);
    RESOLVE(ctx_set_current, "cuCtxSetCurrent", NULL, 1);
    RESOLVE(ctx_get_device, "cuCtxGetDevice", NULL, 1);
    RESOLVE(get_device, NULL, "hipGetDevice", 1);
    RESOLVE(set_device, NULL, "hipSetDevice", 1);
    RESOLVE(module_load_data, "cuModuleLoadData", "hipModuleLoadData", 1);
    RESOLVE(module_get_function, "cuModuleGetFunction", "hipModuleGetFunction", 1);
    RESOLVE(module_unload, "cuModuleUnload", "hipModuleUnload", 1);
    RESOLVE(func_set_attribute, "cuFuncSetAttribute", NULL, 1);
    RESOLVE(launch_kernel, "cuLaunchKernel", "hipModuleLaunchKernel", 1);
    RESOLVE(mem_alloc_async, "cuMemAllocAsync", "hipMallocAsync", 1);
    RESOLVE(mem_free_async, "cuMemFreeAsync", "hipFreeAsync", 1);
    RESOLVE(memset_d8_async, "cuMemsetD8Async", "hipMemsetD8Async", 1);
    RESOLVE(memcpy_htod_async, "cuMemcpyHtoDAsync_v2", "hipMemcpyHtoDAsync", 1);
    RESOLVE(memcpy_dtoh_async, "cuMemcpyDtoHAsync_v2", "hipMemcpyDtoHAsync", 1);
    RESOLVE(stream_synchronize, "cuStreamSynchronize", "hipStreamSynchronize", 1);
    RESOLVE(event_create, "cuEventCreate", "hipEventCreateWithFlags", 1);
    RESOLVE(event_record, "cuEventRecord", "hipEventRecord", 1);
    RESOLVE(stream_wait_event, "cuStreamWaitEvent", "hipStreamWaitEvent", 1);
    RESOLVE(stream_is_capturing, "cuStreamIsCapturing", "hipStreamIsCapturing", 0);
    RESOLVE(graph_create, "cuGraphCreate", NULL, 0);
    RESOLVE(graph_add_kernel_node, "cuGraphAddKernelNode_v2", NULL, 0);
    RESOLVE(graph_instantiate, "cuGraphInstantiateWithFlags", NULL, 0);
    RESOLVE(graph_exec_kernel_node_set_params, "cuGraphExecKernelNodeSetParams_v2", NULL, 0);
    RESOLVE(graph_launch, "cuGraphLaunch", NULL, 0);
    RESOLVE(graph_exec_destroy, "cuGraphExecDestroy", NULL, 0);
    RESOLVE(graph_destroy, "cuGraphDestroy", NULL, 0);
    if (!cuda) {
        /* hipDeviceProp_t changed layout in HIP 6; the R0600 entry point names the new one. */
        RESOLVE(get_device_properties, NULL, "hipGetDevicePropertiesR0600", 0);
        if (g.d.get_device_properties == NULL)
            RESOLVE(get_device_properties, NULL, "hipGetDeviceProperties", 1);
    }
    return FMHA_OK;
}

static int open_library(int backend) {
    static const char *const cuda_names[] = {"libcuda.so.1", "libcuda.so", NULL};
    static const char *const hip_names[] = {"libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6",
                                            "libamdhip64.so.5", NULL};
    char tried[400] = "";
    for (int pass = 0; pass < 2; ++pass) {
        int candidate = pass == 0 ? FMHA_BACKEND_CUDA : FMHA_BACKEND_HIP;
        if (backend != FMHA_BACKEND_AUTO && backend != candidate) continue;
        const char *const *names = candidate == FMHA_BACKEND_CUDA ? cuda_names : hip_names;
        for (int i = 0; names[i]; ++i) {
            void *lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
            if (lib) {
                g.lib = lib;
                g.backend = candidate;
                snprintf(g.library, sizeof g.library, "%s", names[i]);
                return FMHA_OK;
            }
            strncat(tried, tried[0] ? ", " : "", sizeof tried - strlen(tried) - 1);
            strncat(tried, names[i], sizeof tried - strlen(tried) - 1);
        }
    }
    return set_error(FMHA_ERR_NO_DRIVER, "no GPU runtime library found (tried %s)", tried);
}

static int do_init(int backend) {
    for (int i = 0; i < MAX_DEVICES; ++i) pthread_mutex_init(&g.load_locks[i], NULL);
    int status = open_library(backend);
    if (status == FMHA_OK) status = resolve_entry_points();
    if (status != FMHA_OK) return status;
    drv_result r = g.d.init(0);
    if (r == DRV_ERROR_NO_DEVICE || r == DRV_ERROR_INVALID_DEVICE) { /* a valid, empty machine */
        g.device_count = 0;
        return FMHA_OK;
    }
    if (r != 0) return driver_error(r, g.backend == FMHA_BACKEND_CUDA ? "cuInit" : "hipInit", NULL, -1);
    int count = 0;
    r = g.d.device_get_count(&count);
    if (r == DRV_ERROR_NO_DEVICE) count = 0;
    else if (r != 0) return driver_error(r, "device_get_count", NULL, -1);
    g.device_count = count < MAX_DEVICES ? count : MAX_DEVICES;
    return FMHA_OK;
}

int fmha_init(int backend, char *library_out, size_t library_len) {
    pthread_mutex_lock(&g.init_lock);
    if (!g.init_done) {
        g.init_status = do_init(backend);
        snprintf(g.init_error, sizeof g.init_error, "%s", g.init_status ? t_error : "");
        g.init_done = 1;
    }
    int status = g.init_status;
    if (status != FMHA_OK) set_error(status, "%s", g.init_error);
    pthread_mutex_unlock(&g.init_lock);
    if (library_out && library_len) snprintf(library_out, library_len, "%s", g.library);
    return status;
}

static int require_init(void) {
    if (!g.init_done || g.init_status != FMHA_OK)
        return set_error(FMHA_ERR_NOT_INITIALIZED, "the GPU runtime is not initialised");
    return FMHA_OK;
}

static int check_ordinal(int device) {
    int s = require_init();
    if (s != FMHA_OK) return s;
    if (device < 0 || device >= g.device_count)
        return set_error(FMHA_ERR_BAD_ARGUMENT, "device %d does not exist (%d device(s) present)", device,
                         g.device_count);
    return FMHA_OK;
}

int fmha_driver_version(int *version) {
    int s = require_init();
    if (s != FMHA_OK) return s;
    drv_result r = g.d.driver_get_version(version);
    return r ? driver_error(r, "driver_get_version", NULL, -1) : FMHA_OK;
}

int fmha_device_count(int *count) {
    int s = require_init();
    if (s != FMHA_OK) return s;
    *count = g.device_count;
    return FMHA_OK;
}

/* ---- making a device current for one call, and restoring the caller's state ---- */

/* What enter_device changed, so that leave_device can put it back (the public fmha_device_scope). */
typedef fmha_device_scope saved_device;

static int cuda_primary_context(int device, drv_handle *ctx) {
    /* Every launch comes here: once retained, a context is read without taking the lock. */
    *ctx = __atomic_load_n(&g.contexts[device], __ATOMIC_ACQUIRE);
    if (*ctx) return FMHA_OK;
    pthread_mutex_lock(&g.init_lock);
    int status = FMHA_OK;
    if (g.contexts[device] == NULL) {
        int dev = 0;
        drv_result r = g.d.device_get(&dev, device);
        drv_handle retained = NULL;
        if (r == 0) r = g.d.primary_ctx_retain(&retained, dev);
        if (r != 0) status = driver_error(r, "cuDevicePrimaryCtxRetain", NULL, device);
        else __atomic_store_n(&g.contexts[device], retained, __ATOMIC_RELEASE);
    }
    *ctx = g.contexts[device];
    pthread_mutex_unlock(&g.init_lock);
    return status;
}

static int enter_device(int device, saved_device *saved) {
    drv_result r;
    if (g.backend == FMHA_BACKEND_CUDA) {
        drv_handle ctx;
        int s = cuda_primary_context(device, &ctx);
        if (s != FMHA_OK) return s;
        if ((r = g.d.ctx_get_current(&saved->context)) != 0) return driver_error(r, "cuCtxGetCurrent", NULL, device);
        saved->restore = saved->context != ctx;
        if (saved->restore && (r = g.d.ctx_set_current(ctx)) != 0)
            return driver_error(r, "cuCtxSetCurrent", NULL, device);
    } else {
        if ((r = g.d.get_device(&saved->device)) != 0) return driver_error(r, "hipGetDevice", NULL, device);
        saved->restore = saved->device != device;
        if (saved->restore && (r = g.d.set_device(device)) != 0)
            return driver_error(r, "hipSetDevice", NULL, device);
    }
    return FMHA_OK;
}

static void leave_device(const saved_device *saved) {
    if (!saved->restore) return;
    if (g.backend == FMHA_BACKEND_CUDA) g.d.ctx_set_current(saved->context);
    else g.d.set_device(saved->device);
}

int fmha_device_scope_enter(int device, fmha_device_scope *scope) {
    int s = check_ordinal(device);
    if (s != FMHA_OK) return s;
    if (scope == NULL) return set_error(FMHA_ERR_BAD_ARGUMENT, "fmha_device_scope_enter: NULL scope");
    return enter_device(device, scope);
}

int fmha_device_scope_leave(const fmha_device_scope *scope) {
    if (scope == NULL) return set_error(FMHA_ERR_BAD_ARGUMENT, "fmha_device_scope_leave: NULL scope");
    leave_device(scope);
    return FMHA_OK;
}

int fmha_current_device(int *ordinal) {
    int s = require_init();
    if (s != FMHA_OK) return s;
    drv_result r;
    if (g.backend == FMHA_BACKEND_CUDA) {
        drv_handle ctx = NULL;
        if ((r = g.d.ctx_get_current(&ctx)) != 0) return driver_error(r, "cuCtxGetCurrent", NULL, -1);
        if (ctx == NULL) { *ordinal = -1; return FMHA_OK; }
        if ((r = g.d.ctx_get_device(ordinal)) != 0) return driver_error(r, "cuCtxGetDevice", NULL, -1);
        return FMHA_OK;
    }
    if ((r = g.d.get_device(ordinal)) != 0) return driver_error(r, "hipGetDevice", NULL, -1);
    return FMHA_OK;
}

/* ---- device properties ---- */

/* HIP reports the arch only inside hipDeviceProp_t, whose layout differs between HIP versions. The
   field gcnArchName is the only string in it that starts with "gfx", so find it by content. */
static void hip_arch_name(int device, char *out, size_t len) {
    static const size_t props_bytes = 16384; /* larger than any hipDeviceProp_t revision */
    char *props = calloc(1, props_bytes);
    out[0] = 0;
    if (props == NULL || g.d.get_device_properties(props, device) != 0) { free(props); return; }
    for (size_t i = 256; i + 4 < props_bytes; ++i) { /* skip name[256] */
        if (memcmp(props + i, "gfx", 3) == 0) {
            snprintf(out, len, "%.*s", (int)strnlen(props + i, props_bytes - i), props + i);
            break;
        }
    }
    free(props);
}

int fmha_device_get_info(int ordinal, fmha_device_info *info) {
    int s = check_ordinal(ordinal);
    if (s != FMHA_OK) return s;
    memset(info, 0, sizeof *info);
    info->ordinal = ordinal;
    int dev = ordinal;
    drv_result r;
    int cuda = g.backend == FMHA_BACKEND_CUDA;
    if (cuda && (r = g.d.device_get(&dev, ordinal)) != 0) return driver_error(r, "cuDeviceGet", NULL, ordinal);
    if ((r = g.d.device_get_name(info->name, sizeof info->name, dev)) != 0)
        return driver_error(r, "device_get_name", NULL, ordinal);
    size_t total = 0;
    if ((r = g.d.device_total_mem(&total, dev)) != 0) return driver_error(r, "device_total_mem", NULL, ordinal);
    info->total_memory = total;
    r = g.d.device_get_attribute(&info->multiprocessor_count,
                                 cuda ? CU_ATTR_MULTIPROCESSOR_COUNT : HIP_ATTR_MULTIPROCESSOR_COUNT, dev);
    if (r == 0)
        r = g.d.device_get_attribute(&info->max_shared_per_block_optin,
                                     cuda ? CU_ATTR_MAX_SHARED_PER_BLOCK_OPTIN : HIP_ATTR_SHARED_PER_BLOCK_OPTIN, dev);
    if (r != 0) return driver_error(r, "device_get_attribute", NULL, ordinal);
    if (cuda) {
        int major = 0, minor = 0;
        if ((r = g.d.device_get_attribute(&major, CU_ATTR_CC_MAJOR, dev)) != 0 ||
            (r = g.d.device_get_attribute(&minor, CU_ATTR_CC_MINOR, dev)) != 0)
            return driver_error(r, "cuDeviceGetAttribute", NULL, ordinal);
        snprintf(info->arch, sizeof info->arch, "sm_%d%d", major, minor);
        snprintf(info->arch_full, sizeof info->arch_full, "sm_%d%d", major, minor);
    } else {
        hip_arch_name(dev, info->arch_full, sizeof info->arch_full);
        snprintf(info->arch, sizeof info->arch, "%.*s", (int)strcspn(info->arch_full, ":"), info->arch_full);
    }
    return FMHA_OK;
}

/* ---- the kernel map ---- */

/* A linear scan is enough: Python caches the handles it gets, so the map is searched once per
   (device, kernel) and process, not once per launch. */
static fmha_kernel *map_find_locked(int device, const char *key) {
    for (size_t i = 0; i < g.map_len; ++i)
        if (g.map[i]->device == device && strcmp(g.map[i]->key, key) == 0) return g.map[i];
    return NULL;
}

int fmha_kernel_find(int device, const char *key, fmha_kernel **kernel) {
    if (key == NULL || kernel == NULL) return set_error(FMHA_ERR_BAD_ARGUMENT, "NULL key or result");
    pthread_mutex_lock(&g.map_lock);
    *kernel = map_find_locked(device, key);
    pthread_mutex_unlock(&g.map_lock);
    return FMHA_OK;
}

static int load_kernel(int device, const char *key, const void *image, const char *symbol,
                       unsigned int shared_bytes, fmha_kernel **out) {
    fmha_kernel *k = calloc(1, sizeof *k);
    if (k == NULL) return set_error(FMHA_ERR_OUT_OF_MEMORY, "out of host memory loading '%s'", key);
    k->device = device;
    snprintf(k->key, sizeof k->key, "%s", key);
    saved_device saved;
    int s = enter_device(device, &saved);
    if (s != FMHA_OK) { free(k); return s; }
    drv_result r = g.d.module_load_data(&k->module, image);
    if (r != 0) s = driver_error(r, "module_load_data", key, device);
    if (s == FMHA_OK && (r = g.d.module_get_function(&k->function, k->module, symbol)) != 0)
        s = driver_error(r, "module_get_function", key, device);
    k->shared_limit = DEFAULT_SHARED_LIMIT;
    if (s == FMHA_OK && shared_bytes > DEFAULT_SHARED_LIMIT && g.backend == FMHA_BACKEND_CUDA) {
        r = g.d.func_set_attribute(k->function, CU_FUNC_ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES, (int)shared_bytes);
        if (r != 0) s = driver_error(r, "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)", key, device);
        else k->shared_limit = shared_bytes;
    }
    if (s != FMHA_OK && k->module) g.d.module_unload(k->module);
    leave_device(&saved);
    if (s != FMHA_OK) { free(k); return s; }
    *out = k;
    return FMHA_OK;
}

static int map_insert(fmha_kernel *loaded);

static void unload_kernel(fmha_kernel *k) {
    saved_device saved;
    if (enter_device(k->device, &saved) == FMHA_OK) {
        g.d.module_unload(k->module);
        leave_device(&saved);
    }
    free(k);
}

int fmha_kernel_get(int device, const char *key, const void *image, size_t image_size,
                    const char *symbol, unsigned int dynamic_shared_bytes, fmha_kernel **kernel) {
    int s = check_ordinal(device);
    if (s != FMHA_OK) return s;
    if (key == NULL || image == NULL || image_size == 0 || symbol == NULL || kernel == NULL)
        return set_error(FMHA_ERR_BAD_ARGUMENT, "fmha_kernel_get: NULL or empty argument");
    if (strlen(key) >= KEY_LEN)
        return set_error(FMHA_ERR_BAD_ARGUMENT, "kernel key '%s' is longer than %d characters", key, KEY_LEN - 1);
    pthread_mutex_lock(&g.map_lock);
    fmha_kernel *found = map_find_locked(device, key);
    pthread_mutex_unlock(&g.map_lock);
    if (found) { *kernel = found; return FMHA_OK; }

    /* A kernel is loaded once per device: loads on one device take turns, and a thread that waited
       finds what the one before it loaded. The map lock is not held while loading, so lookups,
       launches and loads on other devices go on. */
    pthread_mutex_lock(&g.load_locks[device]);
    pthread_mutex_lock(&g.map_lock);
    found = map_find_locked(device, key);
    pthread_mutex_unlock(&g.map_lock);
    if (found == NULL && (s = load_kernel(device, key, image, symbol, dynamic_shared_bytes, &found)) == FMHA_OK)
        s = map_insert(found);
    pthread_mutex_unlock(&g.load_locks[device]);
    if (s == FMHA_OK) *kernel = found;
    return s;
}

/* Add a loaded kernel to the map (its caller holds its device's load lock); unloads it when the map
   cannot grow. */
static int map_insert(fmha_kernel *loaded) {
    pthread_mutex_lock(&g.map_lock);
    if (g.map_len == g.map_cap) {
        size_t cap = g.map_cap ? 2 * g.map_cap : 64;
        fmha_kernel **grown = realloc(g.map, cap * sizeof *grown);
        if (grown == NULL) {
            pthread_mutex_unlock(&g.map_lock);
            unload_kernel(loaded);
            return set_error(FMHA_ERR_OUT_OF_MEMORY, "out of host memory growing the kernel map");
        }
        g.map = grown;
        g.map_cap = cap;
    }
    g.map[g.map_len++] = loaded;
    pthread_mutex_unlock(&g.map_lock);
    return FMHA_OK;
}

int fmha_kernel_map_size(size_t *count) {
    pthread_mutex_lock(&g.map_lock);
    *count = g.map_len;
    pthread_mutex_unlock(&g.map_lock);
    return FMHA_OK;
}

int fmha_kernel_map_entry(size_t index, int *device, char *key, size_t key_len) {
    int s = FMHA_OK;
    pthread_mutex_lock(&g.map_lock);
    if (index >= g.map_len) s = set_error(FMHA_ERR_BAD_ARGUMENT, "map index %zu out of range", index);
    else {
        *device = g.map[index]->device;
        snprintf(key, key_len, "%s", g.map[index]->key);
    }
    pthread_mutex_unlock(&g.map_lock);
    return s;
}

int fmha_unload_all(void) {
    pthread_mutex_lock(&g.map_lock);
    fmha_kernel **map = g.map;
    size_t n = g.map_len;
    g.map = NULL;
    g.map_len = g.map_cap = 0;
    pthread_mutex_unlock(&g.map_lock);
    for (size_t i = 0; i < n; ++i) unload_kernel(map[i]);
    free(map);
    return FMHA_OK;
}

/* ---- registered images (for launchers without Python: the XLA FFI handler) ---- */

typedef struct registered_image {
    char key[KEY_LEN];
    char symbol[KEY_LEN];
    void *image;
    size_t image_size;
    unsigned int shared_bytes;
} registered_image;

static struct {
    pthread_mutex_t lock;
    registered_image *items;
    size_t len, cap;
} g_images = {PTHREAD_MUTEX_INITIALIZER, NULL, 0, 0};

static registered_image *image_find_locked(const char *key) {
    for (size_t i = 0; i < g_images.len; ++i)
        if (strcmp(g_images.items[i].key, key) == 0) return &g_images.items[i];
    return NULL;
}

int fmha_image_register(const char *key, const void *image, size_t image_size, const char *symbol,
                        unsigned int dynamic_shared_bytes) {
    if (key == NULL || image == NULL || image_size == 0 || symbol == NULL)
        return set_error(FMHA_ERR_BAD_ARGUMENT, "fmha_image_register: NULL or empty argument");
    if (strlen(key) >= KEY_LEN || strlen(symbol) >= KEY_LEN)
        return set_error(FMHA_ERR_BAD_ARGUMENT, "kernel key '%s' or its symbol is longer than %d characters", key,
                         KEY_LEN - 1);
    int s = FMHA_OK;
    pthread_mutex_lock(&g_images.lock);
    registered_image *found = image_find_locked(key);
    if (found) {
        if (found->image_size != image_size || memcmp(found->image, image, image_size) != 0 ||
            strcmp(found->symbol, symbol) != 0 || found->shared_bytes != dynamic_shared_bytes)
            s = set_error(FMHA_ERR_BAD_ARGUMENT, "kernel '%s' is already registered with a different image", key);
        pthread_mutex_unlock(&g_images.lock);
        return s;
    }
    void *copy = malloc(image_size);
    if (copy == NULL) s = set_error(FMHA_ERR_OUT_OF_MEMORY, "out of host memory registering '%s'", key);
    if (s == FMHA_OK && g_images.len == g_images.cap) {
        size_t cap = g_images.cap ? 2 * g_images.cap : 64;
        registered_image *grown = realloc(g_images.items, cap * sizeof *grown);
        if (grown == NULL) s = set_error(FMHA_ERR_OUT_OF_MEMORY, "out of host memory growing the image table");
        else { g_images.items = grown; g_images.cap = cap; }
    }
    if (s == FMHA_OK) {
        registered_image *r = &g_images.items[g_images.len++];
        snprintf(r->key, sizeof r->key, "%s", key);
        snprintf(r->symbol, sizeof r->symbol, "%s", symbol);
        memcpy(copy, image, image_size);
        r->image = copy;
        r->image_size = image_size;
        r->shared_bytes = dynamic_shared_bytes;
        copy = NULL;
    }
    pthread_mutex_unlock(&g_images.lock);
    free(copy);
    return s;
}

int fmha_image_kernel(int device, const char *key, fmha_kernel **kernel) {
    if (key == NULL || kernel == NULL) return set_error(FMHA_ERR_BAD_ARGUMENT, "fmha_image_kernel: NULL argument");
    int s = check_ordinal(device);
    if (s != FMHA_OK) return s;
    if ((s = fmha_kernel_find(device, key, kernel)) != FMHA_OK || *kernel != NULL) return s;
    /* Image bytes are never freed or moved (the table holds them by pointer), so the entry copied
       under the lock stays valid while the load runs outside it. */
    pthread_mutex_lock(&g_images.lock);
    registered_image *found = image_find_locked(key);
    registered_image entry;
    if (found) entry = *found;
    pthread_mutex_unlock(&g_images.lock);
    if (found == NULL)
        return set_error(FMHA_ERR_BAD_ARGUMENT, "kernel '%s' was never registered in this process (its "
                         "program was built elsewhere: trace the call in this process first)", key);
    return fmha_kernel_get(device, key, entry.image, entry.image_size, entry.symbol, entry.shared_bytes, kernel);
}

int fmha_image_count(size_t *count) {
    if (count == NULL) return set_error(FMHA_ERR_BAD_ARGUMENT, "fmha_image_count: NULL argument");
    pthread_mutex_lock(&g_images.lock);
    *count = g_images.len;
    pthread_mutex_unlock(&g_images.lock);
    return FMHA_OK;
}

/* ---- launch ---- */

int fmha_launch(fmha_kernel *k, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                unsigned int by, unsigned int bz, unsigned int shared, uint64_t stream, void *args,
                size_t args_size) {
    if (k == NULL) return set_error(FMHA_ERR_BAD_ARGUMENT, "fmha_launch: NULL kernel");
    if (shared > k->shared_limit)
        return set_error(FMHA_ERR_BAD_ARGUMENT, "kernel '%s' asks for %u bytes of dynamic shared memory, "
                         "above its limit of %u on device %d", k->key, shared, k->shared_limit, k->device);
    void *extra[] = {LAUNCH_PARAM_BUFFER_POINTER, args, LAUNCH_PARAM_BUFFER_SIZE, &args_size,
                     g.backend == FMHA_BACKEND_CUDA ? CUDA_LAUNCH_PARAM_END : HIP_LAUNCH_PARAM_END};
    saved_device saved;
    int s = enter_device(k->device, &saved);
    if (s != FMHA_OK) return s;
    drv_result r = g.d.launch_kernel(k->function, gx, gy, gz, bx, by, bz, shared, stream, NULL, extra);
    leave_device(&saved);
    return r ? driver_error(r, g.backend == FMHA_BACKEND_CUDA ? "cuLaunchKernel" : "hipModuleLaunchKernel",
                            k->key, k->device)
             : FMHA_OK;
}

int fmha_launch_prepared(const fmha_launch_config *c, uint64_t stream) {
    if (c == NULL) return set_error(FMHA_ERR_BAD_ARGUMENT, "fmha_launch_prepared: NULL config");
    return fmha_launch(c->kernel, c->grid[0], c->grid[1], c->grid[2], c->block[0], c->block[1], c->block[2],
                       c->dynamic_shared_bytes, stream, c->args, c->args_size);
}

/* ---- launch graphs ---- */

/* CUDA_KERNEL_NODE_PARAMS_v2: the function, its launch shape, the arguments as a packed buffer in
   `extra`; kern and ctx unused (NULL) since func is given. */
typedef struct {
    drv_handle func;
    unsigned int grid[3], block[3], shared_bytes;
    void **kernel_params;
    void **extra;
    drv_handle kern, ctx;
} cuda_kernel_node_params;

typedef struct launch_graph {
    int device;
    size_t count;
    drv_handle graph, exec;
    drv_handle nodes[FMHA_LAUNCH_GRAPH_MAX_NODES];
    char kernels[FMHA_LAUNCH_GRAPH_MAX_NODES * KEY_LEN]; /* their keys, for messages */
} launch_graph;

/* The node parameters of a launch config; `extra` is the caller's array of five. */
static cuda_kernel_node_params node_params(const fmha_launch_config *c, void **extra) {
    extra[0] = LAUNCH_PARAM_BUFFER_POINTER;
    extra[1] = c->args;
    extra[2] = LAUNCH_PARAM_BUFFER_SIZE;
    extra[3] = (void *)&c->args_size;
    extra[4] = CUDA_LAUNCH_PARAM_END;
    return (cuda_kernel_node_params){c->kernel->function, {c->grid[0], c->grid[1], c->grid[2]},
                                     {c->block[0], c->block[1], c->block[2]}, c->dynamic_shared_bytes, NULL, extra,
                                     NULL, NULL};
}

static int graph_free(launch_graph *lg) {
    drv_result r = 0;
    if (lg->exec != NULL) r = g.d.graph_exec_destroy(lg->exec);
    if (lg->graph != NULL) g.d.graph_destroy(lg->graph);
    int device = lg->device;
    free(lg);
    return r ? driver_error(r, "cuGraphExecDestroy", NULL, device) : FMHA_OK;
}

int fmha_graph_create(int device, const fmha_launch_config *launches, size_t count, void **graph) {
    int s = check_ordinal(device);
    if (s != FMHA_OK) return s;
    if (g.d.graph_create == NULL || g.d.graph_add_kernel_node == NULL || g.d.graph_instantiate == NULL ||
        g.d.graph_exec_kernel_node_set_params == NULL || g.d.graph_launch == NULL || g.d.graph_exec_destroy == NULL ||
        g.d.graph_destroy == NULL)
        return set_error(FMHA_ERR_NO_SYMBOL, "%s has no graph entry points", g.library);
    if (launches == NULL || graph == NULL || count == 0 || count > FMHA_LAUNCH_GRAPH_MAX_NODES)
        return set_error(FMHA_ERR_BAD_ARGUMENT, "fmha_graph_create: NULL argument or %zu launches", count);
    for (size_t i = 0; i < count; ++i) {
        const fmha_kernel *k = launches[i].kernel;
        if (k == NULL || k->device != device || launches[i].dynamic_shared_bytes > k->shared_limit)
            return set_error(FMHA_ERR_BAD_ARGUMENT, "fmha_graph_create: launch %zu's kernel is not on device %d "
                             "or asks for more shared memory than its limit", i, device);
    }
    launch_graph *lg = calloc(1, sizeof *lg);
    if (lg == NULL) return set_error(FMHA_ERR_OUT_OF_MEMORY, "out of host memory making a launch graph");
    lg->device = device;
    lg->count = count;
    for (size_t i = 0; i < count; ++i) {
        size_t used = strlen(lg->kernels);
        snprintf(lg->kernels + used, sizeof lg->kernels - used, "%s%s", i ? "', '" : "", launches[i].kernel->key);
    }
    saved_device saved;
    if ((s = enter_device(device, &saved)) != FMHA_OK) {
        free(lg);
        return s;
    }
    const char *call = "cuGraphCreate";
    const char *kernel = NULL;
    drv_result r = g.d.graph_create(&lg->graph, 0);
    for (size_t i = 0; r == 0 && i < count; ++i) {
        void *extra[5];
        cuda_kernel_node_params params = node_params(&launches[i], extra);
        call = "cuGraphAddKernelNode";
        kernel = launches[i].kernel->key;
        r = g.d.graph_add_kernel_node(&lg->nodes[i], lg->graph, i ? &lg->nodes[i - 1] : NULL, i ? 1 : 0, &params);
    }
    if (r == 0) {
        call = "cuGraphInstantiateWithFlags";
        kernel = lg->kernels;
        r = g.d.graph_instantiate(&lg->exec, lg->graph, 0);
    }
    leave_device(&saved);
    if (r != 0) {
        s = driver_error(r, call, kernel, device);
        char message[sizeof t_error];
        snprintf(message, sizeof message, "%s", t_error);
        graph_free(lg);
        return set_error(s, "%s", message);
    }
    *graph = lg;
    return FMHA_OK;
}

int fmha_graph_launch(void *graph, const fmha_launch_config *launches, size_t count, uint64_t stream,
                      size_t *failed) {
    launch_graph *lg = graph;
    if (lg == NULL || launches == NULL || failed == NULL || count != lg->count)
        return set_error(FMHA_ERR_BAD_ARGUMENT, "fmha_graph_launch: NULL argument or not the graph's launches");
    saved_device saved;
    int s = enter_device(lg->device, &saved);
    if (s != FMHA_OK) return s;
    drv_result r = 0;
    for (size_t i = 0; r == 0 && i < count; ++i) {
        void *extra[5];
        cuda_kernel_node_params params = node_params(&launches[i], extra);
        r = g.d.graph_exec_kernel_node_set_params(lg->exec, lg->nodes[i], &params);
        if (r != 0) {
            *failed = i;
            s = driver_error(r, "cuGraphExecKernelNodeSetParams", launches[i].kernel->key, lg->device);
        }
    }
    if (r == 0 && (r = g.d.graph_launch(lg->exec, stream)) != 0) {
        *failed = 0;
        s = driver_error(r, "cuGraphLaunch", lg->kernels, lg->device);
    }
    leave_device(&saved);
    return s;
}

int fmha_graph_destroy(void *graph) {
    if (graph == NULL) return set_error(FMHA_ERR_BAD_ARGUMENT, "fmha_graph_destroy: NULL graph");
    launch_graph *lg = graph;
    saved_device saved;
    int s = enter_device(lg->device, &saved);
    if (s != FMHA_OK) return s;
    s = graph_free(lg);
    leave_device(&saved);
    return s;
}

/* ---- memory ---- */

#define ON_DEVICE(device, call_name, expr)                                  \
    do {                                                                    \
        int s_ = check_ordinal(device);                                     \
        if (s_ != FMHA_OK) return s_;                                       \
        saved_device saved_;                                                \
        if ((s_ = enter_device((device), &saved_)) != FMHA_OK) return s_;   \
        drv_result r_ = (expr);                                             \
        leave_device(&saved_);                                    \
        return r_ ? driver_error(r_, (call_name), NULL, (device)) : FMHA_OK; \
    } while (0)

int fmha_mem_alloc(int device, size_t bytes, uint64_t stream, uint64_t *ptr) {
    ON_DEVICE(device, "mem_alloc_async", g.d.mem_alloc_async(ptr, bytes, stream));
}
int fmha_mem_free(int device, uint64_t ptr, uint64_t stream) {
    ON_DEVICE(device, "mem_free_async", g.d.mem_free_async(ptr, stream));
}
int fmha_memset_d8(int device, uint64_t ptr, unsigned char value, size_t bytes, uint64_t stream) {
    ON_DEVICE(device, "memset_d8_async", g.d.memset_d8_async(ptr, value, bytes, stream));
}
int fmha_memcpy_htod(int device, uint64_t dst, const void *src, size_t bytes, uint64_t stream) {
    ON_DEVICE(device, "memcpy_htod_async", g.d.memcpy_htod_async(dst, src, bytes, stream));
}
int fmha_memcpy_dtoh(int device, void *dst, uint64_t src, size_t bytes, uint64_t stream) {
    ON_DEVICE(device, "memcpy_dtoh_async", g.d.memcpy_dtoh_async(dst, src, bytes, stream));
}
int fmha_stream_synchronize(int device, uint64_t stream) {
    ON_DEVICE(device, "stream_synchronize", g.d.stream_synchronize(stream));
}
int fmha_stream_capture_status(int device, uint64_t stream, int *status) {
    if (status == NULL) return set_error(FMHA_ERR_BAD_ARGUMENT, "fmha_stream_capture_status: NULL status");
    if (require_init() == FMHA_OK && g.d.stream_is_capturing == NULL)
        return set_error(FMHA_ERR_NO_SYMBOL, "%s has no stream capture query", g.library);
    ON_DEVICE(device, "stream_is_capturing", g.d.stream_is_capturing(stream, status));
}

/* ---- where a pointer lives, and ordering streams by events ---- */

/* The query needs a current context on CUDA; a thread that never made one current (its arrays came
   from another thread) asks from device 0's primary context, which sees every device's allocations
   (unified addressing). cuPointerGetAttributes answers memory type 0 for an address it does not know. */
static int cuda_pointer_location(uint64_t ptr, int *device, int *memory_type) {
    drv_handle current = NULL;
    saved_device saved = {NULL, 0, 0};
    int s = g.d.ctx_get_current(&current) == 0 && current == NULL ? enter_device(0, &saved) : FMHA_OK;
    if (s != FMHA_OK) return s;
    static const int attributes[2] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
    unsigned int type = 0;
    void *data[2] = {&type, device};
    drv_result r = g.d.pointer_get_attributes(2, attributes, data, ptr);
    leave_device(&saved);
    if (r != 0) return driver_error(r, "cuPointerGetAttributes", NULL, -1);
    if (type == 0) return set_error(FMHA_ERR_BAD_ARGUMENT, "0x%llx is not memory the driver knows", (unsigned long long)ptr);
    *memory_type = (int)type;
    return FMHA_OK;
}

/* The leading fields of hipPointerAttribute_t (memory type, device), which every HIP release keeps;
   `rest` is room for the fields after them, whose layout changed between releases. */
typedef struct {
    _Alignas(16) int memory_type;
    int device;
    char rest[248];
} hip_pointer_attributes;

/* A failed query is also the thread's last HIP error, which a framework's next error check would
   take for its own: it is cleared. */
static int hip_pointer_location(uint64_t ptr, int *device, int *memory_type) {
    hip_pointer_attributes a;
    memset(&a, 0, sizeof a);
    drv_result r = g.d.hip_pointer_get_attributes(&a, ptr);
    if (r != 0) {
        g.d.hip_get_last_error();
        return driver_error(r, "hipPointerGetAttributes", NULL, -1);
    }
    *device = a.device;
    *memory_type = a.memory_type;
    return FMHA_OK;
}

int fmha_pointer_location(uint64_t ptr, int *device_type, int *device, int *memory_type) {
    int s = require_init();
    if (s != FMHA_OK) return s;
    if (device_type == NULL || device == NULL || memory_type == NULL)
        return set_error(FMHA_ERR_BAD_ARGUMENT, "fmha_pointer_location: NULL result");
    int cuda = g.backend == FMHA_BACKEND_CUDA;
    *device_type = cuda ? DLPACK_CUDA : DLPACK_ROCM;
    return cuda ? cuda_pointer_location(ptr, device, memory_type) : hip_pointer_location(ptr, device, memory_type);
}

int fmha_event_create(int device, uint64_t *event) {
    ON_DEVICE(device, "event_create", g.d.event_create(event, EVENT_DISABLE_TIMING));
}
int fmha_event_record(int device, uint64_t event, uint64_t stream) {
    ON_DEVICE(device, "event_record", g.d.event_record(event, stream));
}
int fmha_stream_wait_event(int device, uint64_t stream, uint64_t event) {
    ON_DEVICE(device, "stream_wait_event", g.d.stream_wait_event(stream, event, 0));
}
