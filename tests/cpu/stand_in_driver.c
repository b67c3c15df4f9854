/* A CUDA driver with two sm_90 devices and no GPU, built as libcuda.so.1 for a test process, so that the
   shim's (device, kernel) map runs for real: it counts module loads and unloads per device, hands out
   module and function handles that know their device, and counts for every launch whether the
   function belongs to the device whose context is current. Module loads are slow on purpose, to give
   racing threads time to meet. Memory, copies and events are not served. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define DEVICES 2
#define NOT_SUPPORTED 801 /* CUDA_ERROR_NOT_SUPPORTED */
#define INVALID_CONTEXT 201

typedef struct { int device; } stand_in_module; /* a module and its one function */

static int contexts[DEVICES];   /* primary context of device d: &contexts[d] */
static __thread int current = -1;
static int loads[DEVICES], unloads[DEVICES], launches[DEVICES], foreign_launches;

int stand_in_loads(int device) { return __atomic_load_n(&loads[device], __ATOMIC_SEQ_CST); }
int stand_in_unloads(int device) { return __atomic_load_n(&unloads[device], __ATOMIC_SEQ_CST); }
int stand_in_launches(int device) { return __atomic_load_n(&launches[device], __ATOMIC_SEQ_CST); }
/* launches of a function loaded on another device than the current one */
int stand_in_foreign_launches(void) { return __atomic_load_n(&foreign_launches, __ATOMIC_SEQ_CST); }

int cuInit(unsigned flags) { (void)flags; return 0; }
int cuDriverGetVersion(int *version) { *version = 13000; return 0; }
int cuGetErrorName(int error, const char **name) { (void)error; *name = "CUDA_ERROR_STAND_IN"; return 0; }
int cuDeviceGetCount(int *count) { *count = DEVICES; return 0; }
int cuDeviceGet(int *device, int ordinal) { *device = ordinal; return 0; }
int cuDeviceGetName(char *name, int len, int device) {
    (void)device;
    strncpy(name, "Stand-in GPU", (size_t)len);
    return 0;
}
int cuDeviceTotalMem_v2(size_t *bytes, int device) { (void)device; *bytes = (size_t)1 << 37; return 0; }

int cuDeviceGetAttribute(int *value, int attribute, int device) {
    (void)device;
    switch (attribute) {
    case 16: *value = 132; break;      /* multiprocessors */
    case 75: *value = 9; break;        /* compute capability major */
    case 76: *value = 0; break;        /* minor */
    case 97: *value = 232448; break;   /* shared memory per block, opt-in */
    default: *value = 0;
    }
    return 0;
}

int cuDevicePrimaryCtxRetain(void **context, int device) { *context = &contexts[device]; return 0; }
int cuCtxGetCurrent(void **context) { *context = current < 0 ? NULL : &contexts[current]; return 0; }
int cuCtxSetCurrent(void *context) { current = context ? (int)((int *)context - contexts) : -1; return 0; }
int cuCtxGetDevice(int *device) { *device = current; return current < 0 ? INVALID_CONTEXT : 0; }

int cuModuleLoadData(void **module, const void *image) {
    (void)image;
    if (current < 0) return INVALID_CONTEXT;
    usleep(20000);
    stand_in_module *m = malloc(sizeof *m);
    m->device = current;
    __atomic_add_fetch(&loads[current], 1, __ATOMIC_SEQ_CST);
    *module = m;
    return 0;
}

int cuModuleGetFunction(void **function, void *module, const char *name) {
    (void)name;
    *function = module;
    return 0;
}

int cuModuleUnload(void *module) {
    __atomic_add_fetch(&unloads[((stand_in_module *)module)->device], 1, __ATOMIC_SEQ_CST);
    free(module);
    return 0;
}

int cuFuncSetAttribute(void *function, int attribute, int value) { (void)function; (void)attribute; (void)value; return 0; }

int cuLaunchKernel(void *function, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shared, uint64_t stream, void **params, void **extra) {
    (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shared; (void)stream; (void)params; (void)extra;
    if (current < 0) return INVALID_CONTEXT;
    if (((stand_in_module *)function)->device != current) __atomic_add_fetch(&foreign_launches, 1, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&launches[current], 1, __ATOMIC_SEQ_CST);
    return 0;
}

int cuPointerGetAttributes(unsigned n, const int *attributes, void **data, uint64_t ptr) {
    (void)n; (void)attributes; (void)data; (void)ptr;
    return NOT_SUPPORTED;
}
int cuMemAllocAsync(uint64_t *ptr, size_t bytes, uint64_t stream) { (void)ptr; (void)bytes; (void)stream; return NOT_SUPPORTED; }
int cuMemFreeAsync(uint64_t ptr, uint64_t stream) { (void)ptr; (void)stream; return NOT_SUPPORTED; }
int cuMemsetD8Async(uint64_t ptr, unsigned char value, size_t bytes, uint64_t stream) {
    (void)ptr; (void)value; (void)bytes; (void)stream;
    return NOT_SUPPORTED;
}
int cuMemcpyHtoDAsync_v2(uint64_t dst, const void *src, size_t bytes, uint64_t stream) {
    (void)dst; (void)src; (void)bytes; (void)stream;
    return NOT_SUPPORTED;
}
int cuMemcpyDtoHAsync_v2(void *dst, uint64_t src, size_t bytes, uint64_t stream) {
    (void)dst; (void)src; (void)bytes; (void)stream;
    return NOT_SUPPORTED;
}
int cuStreamSynchronize(uint64_t stream) { (void)stream; return 0; }
int cuEventCreate(uint64_t *event, unsigned flags) { (void)event; (void)flags; return NOT_SUPPORTED; }
int cuEventRecord(uint64_t event, uint64_t stream) { (void)event; (void)stream; return NOT_SUPPORTED; }
int cuStreamWaitEvent(uint64_t stream, uint64_t event, unsigned flags) { (void)stream; (void)event; (void)flags; return NOT_SUPPORTED; }
