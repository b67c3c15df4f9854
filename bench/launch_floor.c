/* The floor for one tiny launch: a C loop calling the CUDA driver's launch directly, with the same
   kernel (the self-test axpy), grid and packed-argument path the fmha_rt shim uses.
   Build: gcc -O2 -o launch_floor launch_floor.c -ldl
   Run:   ./launch_floor <axpy.cubin> <symbol> <launches> [batch [graph_nodes]]   prints microseconds per call
   With a batch, the loop synchronizes every `batch` calls outside the timed region, so the launch
   queue never fills and the figure is the host's own cost; without, a launch also waits whenever the
   GPU runs the tiny kernels slower than the host issues them. With graph_nodes N > 0, a call is what a
   cached call's launch graph costs: set the arguments of a graph's N kernel nodes (a chain of the same
   kernel, instantiated once) and launch the graph. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef int (*fn_init)(unsigned);
typedef int (*fn_dev)(int *, int);
typedef int (*fn_ctx)(void **, int);
typedef int (*fn_set)(void *);
typedef int (*fn_load)(void **, const void *);
typedef int (*fn_get)(void **, void *, const char *);
typedef int (*fn_alloc)(uint64_t *, size_t);
typedef int (*fn_launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                         void **, void **);
typedef int (*fn_sync)(void);
/* CUDA_KERNEL_NODE_PARAMS_v2 */
typedef struct {
    void *func;
    unsigned grid[3], block[3], shared;
    void **params, **extra;
    void *kern, *ctx;
} node_params;
typedef int (*fn_graph_create)(void **, unsigned);
typedef int (*fn_graph_add_kernel)(void **, void *, void **, size_t, const node_params *);
typedef int (*fn_graph_instantiate)(void **, void *, unsigned long long);
typedef int (*fn_graph_set)(void *, void *, const node_params *);
typedef int (*fn_graph_launch)(void *, void *);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

#define CHECK(x) do { int r_ = (x); if (r_) { fprintf(stderr, "%s failed: %d\n", #x, r_); return 1; } } while (0)

int main(int argc, char **argv) {
    if (argc < 4 || argc > 6) {
        fprintf(stderr, "usage: %s cubin symbol launches [batch [graph_nodes]]\n", argv[0]);
        return 2;
    }
    FILE *f = fopen(argv[1], "rb");
    if (!f) { perror(argv[1]); return 1; }
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *image = malloc(size);
    if (fread(image, 1, size, f) != (size_t)size) return 1;
    fclose(f);
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) { fprintf(stderr, "no libcuda.so.1\n"); return 1; }
    int dev;
    void *ctx, *mod, *fn;
    uint64_t x, y, out;
    CHECK(((fn_init)dlsym(lib, "cuInit"))(0));
    CHECK(((fn_dev)dlsym(lib, "cuDeviceGet"))(&dev, 0));
    CHECK(((fn_ctx)dlsym(lib, "cuDevicePrimaryCtxRetain"))(&ctx, dev));
    CHECK(((fn_set)dlsym(lib, "cuCtxSetCurrent"))(ctx));
    CHECK(((fn_load)dlsym(lib, "cuModuleLoadData"))(&mod, image));
    CHECK(((fn_get)dlsym(lib, "cuModuleGetFunction"))(&fn, mod, argv[2]));
    fn_alloc alloc = (fn_alloc)dlsym(lib, "cuMemAlloc_v2");
    CHECK(alloc(&x, 4096)); CHECK(alloc(&y, 4096)); CHECK(alloc(&out, 4096));
    fn_launch launch = (fn_launch)dlsym(lib, "cuLaunchKernel");
    fn_sync sync = (fn_sync)dlsym(lib, "cuCtxSynchronize");
    /* axpy(x, y, out, alpha f32, n i32, global_scratch, profile_scratch): the layout of the manifest */
    struct { uint64_t x, y, out; float alpha; int n; uint64_t scratch0, scratch1; } args = {x, y, out, 2.0f, 1024, 0, 0};
    size_t args_size = sizeof args;
    void *extra[] = {(void *)1, &args, (void *)2, &args_size, (void *)0};
    long n = atol(argv[3]);
    long batch = argc >= 5 ? atol(argv[4]) : n;
    if (batch <= 0) batch = n;
    int nodes = argc == 6 ? atoi(argv[5]) : 0;
    if (nodes < 0 || nodes > 8) { fprintf(stderr, "graph_nodes: 0 to 8\n"); return 2; }
    void *graph = NULL, *exec = NULL, *node[8];
    node_params params = {fn, {1, 1, 1}, {128, 1, 1}, 0, NULL, extra, NULL, NULL};
    fn_graph_set set = (fn_graph_set)dlsym(lib, "cuGraphExecKernelNodeSetParams_v2");
    fn_graph_launch graph_launch = (fn_graph_launch)dlsym(lib, "cuGraphLaunch");
    if (nodes > 0) {
        CHECK(((fn_graph_create)dlsym(lib, "cuGraphCreate"))(&graph, 0));
        fn_graph_add_kernel add = (fn_graph_add_kernel)dlsym(lib, "cuGraphAddKernelNode_v2");
        for (int j = 0; j < nodes; ++j) CHECK(add(&node[j], graph, j ? &node[j - 1] : NULL, j ? 1 : 0, &params));
        CHECK(((fn_graph_instantiate)dlsym(lib, "cuGraphInstantiateWithFlags"))(&exec, graph, 0));
    }
#define CALL()                                                                      \
    do {                                                                            \
        if (nodes == 0) {                                                           \
            CHECK(launch(fn, 1, 1, 1, 128, 1, 1, 0, NULL, NULL, extra));            \
        } else {                                                                    \
            for (int j = 0; j < nodes; ++j) CHECK(set(exec, node[j], &params));     \
            CHECK(graph_launch(exec, NULL));                                        \
        }                                                                           \
    } while (0)
    for (int i = 0; i < 1000; ++i) CALL();
    CHECK(sync());
    double spent = 0;
    for (long done = 0; done < n; done += batch) {
        double t0 = now();
        for (long i = done; i < n && i < done + batch; ++i) CALL();
        spent += now() - t0;
        CHECK(sync());
    }
    printf("%.3f\n", spent / n * 1e6);
    return 0;
}
