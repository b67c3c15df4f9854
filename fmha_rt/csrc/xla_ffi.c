/*
 * fmha_rt's XLA FFI handler: runs a launch program on the stream and device that XLA hands over.
 *
 * A launch program (built at trace time by fmha_rt/replay/xla_program.py, which documents the format) is
 * an int64 array attribute of the custom call: the buffers the call must receive, the workspace
 * regions to zero, and per launch the kernel key, grid, block, shared memory, the packed argument
 * template and the pointer slots to fill with buffer addresses. Everything the handler needs is in
 * the program, the call's buffers and the shim (kernel images registered at trace time, the kernel
 * map, and fmha_replay, which runs the plan-cache hits of the Python API too), so it never calls into
 * Python and never takes the GIL.
 *
 * Written against XLA's C FFI API (xla/ffi/api/c_api.h from jaxlib) and nothing else of XLA's.
 */
#include "fmha_rt.h"

#include "xla/ffi/api/c_api.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PROGRAM_MAGIC 0x3147525041484D46LL /* the bytes "FMHAPRG1" read as a little-endian int64 */
#define PROGRAM_FORMAT 2
#define PROGRAM_ATTRIBUTE "program"
#define MAX_BUFFERS 32
_Static_assert(MAX_BUFFERS <= FMHA_REPLAY_MAX_VALUES, "a call's buffers are the replay's values");
#define MAX_LAUNCHES 16
#define MAX_PATCHES 128
#define MAX_TEMPLATE_BYTES FMHA_REPLAY_MAX_ARGS /* the manifest's limit on a kernel's parameter bytes */
#define KEY_CHARS 160           /* the shim's kernel key limit */
#define LABEL_CHARS 256
#define MAX_POINTER_ALIGN 4096

void fmha_xla_ffi_api_version(int *major, int *minor) {
    *major = XLA_FFI_API_MAJOR;
    *minor = XLA_FFI_API_MINOR;
}

/* ---- the decoded program ---- */

typedef struct patch {
    size_t arg_offset; /* byte offset of the pointer slot in the argument template */
    size_t buffer;     /* operands first, then results */
    uint64_t offset;   /* bytes into that buffer */
    uint32_t align;    /* the address must be a multiple of this: the kernel's promise (a power of two) */
} patch;

typedef struct zero_fill {
    size_t buffer;
    uint64_t offset, nbytes;
} zero_fill;

typedef struct launch {
    char key[KEY_CHARS];
    unsigned int grid[3], block[3], shared_bytes;
    const char *template_bytes; /* inside the attribute */
    size_t args_size;
    size_t first_patch, patch_count;
} launch;

typedef struct program {
    char label[LABEL_CHARS];
    size_t operands, results, fill_count, launch_count;
    int64_t dtype[MAX_BUFFERS];
    uint64_t nbytes[MAX_BUFFERS];
    zero_fill fills[MAX_BUFFERS];
    launch launches[MAX_LAUNCHES];
    patch patches[MAX_PATCHES];
} program;

/* Reads int64 words with bounds checks; any read past the end, or a value out of its range, marks
   the program malformed and yields 0. */
typedef struct reader {
    const int64_t *words;
    size_t count, next;
    int bad;
} reader;

static int64_t read_word(reader *r) {
    if (r->next >= r->count) {
        r->bad = 1;
        return 0;
    }
    return r->words[r->next++];
}

static uint64_t read_range(reader *r, int64_t lo, int64_t hi) {
    int64_t v = read_word(r);
    if (v < lo || v > hi) {
        r->bad = 1;
        return 0;
    }
    return (uint64_t)v;
}

/* Bytes: their length, then the bytes packed eight to a word in memory order (the program is built
   on a little-endian host for a little-endian host). Returns a pointer into the program. */
static const char *read_bytes(reader *r, size_t limit, size_t *len) {
    *len = (size_t)read_range(r, 0, (int64_t)limit);
    size_t words = (*len + 7) / 8;
    if (r->bad || words > r->count - r->next) {
        r->bad = 1;
        *len = 0;
        return NULL;
    }
    const char *bytes = (const char *)(r->words + r->next);
    r->next += words;
    return bytes;
}

static void read_string(reader *r, char *out, size_t out_size) {
    size_t len;
    const char *bytes = read_bytes(r, out_size - 1, &len);
    memcpy(out, bytes ? bytes : "", len);
    out[len] = 0;
}

/* Decodes `words` into `p`; returns NULL or what is wrong. */
static const char *decode(const int64_t *words, size_t count, program *p) {
    reader r = {words, count, 0, 0};
    if (read_word(&r) != PROGRAM_MAGIC) return "it does not start with the launch program magic";
    if (read_word(&r) != PROGRAM_FORMAT) return "its format version is not the one this shim reads";
    p->operands = read_range(&r, 0, MAX_BUFFERS);
    p->results = read_range(&r, 0, MAX_BUFFERS);
    p->fill_count = read_range(&r, 0, MAX_BUFFERS);
    p->launch_count = read_range(&r, 0, MAX_LAUNCHES);
    if (r.bad || p->operands + p->results > MAX_BUFFERS) return "its header is out of range";
    read_string(&r, p->label, sizeof p->label);
    size_t buffers = p->operands + p->results;
    for (size_t i = 0; i < buffers; ++i) {
        p->dtype[i] = read_word(&r);
        p->nbytes[i] = read_range(&r, 0, INT64_MAX);
    }
    for (size_t i = 0; i < p->fill_count; ++i) {
        p->fills[i].buffer = read_range(&r, 0, (int64_t)buffers - 1);
        p->fills[i].offset = read_range(&r, 0, INT64_MAX);
        p->fills[i].nbytes = read_range(&r, 0, INT64_MAX);
    }
    size_t patches = 0;
    for (size_t i = 0; i < p->launch_count && !r.bad; ++i) {
        launch *l = &p->launches[i];
        read_string(&r, l->key, sizeof l->key);
        for (int d = 0; d < 3; ++d) l->grid[d] = (unsigned int)read_range(&r, 1, UINT32_MAX);
        for (int d = 0; d < 3; ++d) l->block[d] = (unsigned int)read_range(&r, 1, 1024);
        l->shared_bytes = (unsigned int)read_range(&r, 0, UINT32_MAX);
        l->template_bytes = read_bytes(&r, MAX_TEMPLATE_BYTES, &l->args_size);
        l->first_patch = patches;
        l->patch_count = read_range(&r, 0, MAX_PATCHES - (int64_t)patches);
        for (size_t j = 0; j < l->patch_count && !r.bad; ++j, ++patches) {
            patch *pt = &p->patches[patches];
            pt->arg_offset = read_range(&r, 0, (int64_t)l->args_size - 8);
            pt->buffer = read_range(&r, 0, (int64_t)buffers - 1);
            pt->offset = read_range(&r, 0, INT64_MAX);
            pt->align = (uint32_t)read_range(&r, 1, MAX_POINTER_ALIGN);
            if (pt->align & (pt->align - 1)) r.bad = 1;
        }
    }
    if (r.bad) return "it is truncated or holds a value out of range";
    if (r.next != r.count) return "it has words past its end";
    return NULL;
}

/* ---- errors ---- */

static XLA_FFI_Error *fail(const XLA_FFI_Api *api, XLA_FFI_Error_Code code, const char *fmt, ...) {
    char message[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(message, sizeof message, fmt, ap);
    va_end(ap);
    XLA_FFI_Error_Create_Args args = {XLA_FFI_Error_Create_Args_STRUCT_SIZE, NULL, message, code};
    return api->XLA_FFI_Error_Create(&args); /* XLA copies the message */
}

static void drop_error(const XLA_FFI_Api *api, XLA_FFI_Error *error) {
    XLA_FFI_Error_Destroy_Args args = {XLA_FFI_Error_Destroy_Args_STRUCT_SIZE, NULL, error};
    api->XLA_FFI_Error_Destroy(&args);
}

/* ---- what XLA hands over ---- */

/* XLA asks a handler for its API version and traits by calling it with a metadata extension. No
   traits: the handler may load a module on its first call, which must not happen during a CUDA
   graph capture, so it does not declare itself command-buffer compatible. (The extension list's type
   was renamed between FFI API versions, hence __typeof__.) */
static int answer_metadata(XLA_FFI_CallFrame *frame) {
    for (__typeof__(frame->extension_start) ext = frame->extension_start; ext != NULL; ext = ext->next) {
        if (ext->type != XLA_FFI_Extension_Metadata) continue;
        XLA_FFI_Metadata *metadata = ((XLA_FFI_Metadata_Extension *)ext)->metadata;
        metadata->api_version.major_version = XLA_FFI_API_MAJOR;
        metadata->api_version.minor_version = XLA_FFI_API_MINOR;
        metadata->traits = 0;
        return 1;
    }
    return 0;
}

static const XLA_FFI_Array *program_attribute(const XLA_FFI_CallFrame *frame) {
    size_t name_len = strlen(PROGRAM_ATTRIBUTE);
    for (int64_t i = 0; i < frame->attrs.size; ++i) {
        const XLA_FFI_ByteSpan *name = frame->attrs.names[i];
        if (name->len == name_len && memcmp(name->ptr, PROGRAM_ATTRIBUTE, name_len) == 0) {
            if (frame->attrs.types[i] != XLA_FFI_AttrType_ARRAY) return NULL;
            const XLA_FFI_Array *array = frame->attrs.attrs[i];
            return array->dtype == XLA_FFI_DataType_S64 ? array : NULL;
        }
    }
    return NULL;
}

static int64_t element_bytes(XLA_FFI_DataType dtype) {
    switch (dtype) {
    case XLA_FFI_DataType_PRED: case XLA_FFI_DataType_S8: case XLA_FFI_DataType_U8: return 1;
    case XLA_FFI_DataType_S16: case XLA_FFI_DataType_U16: case XLA_FFI_DataType_F16: case XLA_FFI_DataType_BF16:
        return 2;
    case XLA_FFI_DataType_S32: case XLA_FFI_DataType_U32: case XLA_FFI_DataType_F32: return 4;
    case XLA_FFI_DataType_S64: case XLA_FFI_DataType_U64: case XLA_FFI_DataType_F64: return 8;
    default: return -1;
    }
}

static const XLA_FFI_Buffer *buffer_at(const XLA_FFI_CallFrame *frame, const program *p, size_t i) {
    return i < p->operands ? frame->args.args[i] : frame->rets.rets[i - p->operands];
}

static XLA_FFI_Error *check_buffers(const XLA_FFI_Api *api, const XLA_FFI_CallFrame *frame, const program *p) {
    if (frame->args.size != (int64_t)p->operands || frame->rets.size != (int64_t)p->results)
        return fail(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "fmha_rt %s: the call has %lld operands and %lld "
                    "results, its launch program expects %zu and %zu", p->label, (long long)frame->args.size,
                    (long long)frame->rets.size, p->operands, p->results);
    for (size_t i = 0; i < p->operands + p->results; ++i) {
        int operand = i < p->operands;
        if ((operand ? frame->args.types[i] != XLA_FFI_ArgType_BUFFER
                     : frame->rets.types[i - p->operands] != XLA_FFI_RetType_BUFFER))
            return fail(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "fmha_rt %s: %s %zu is not a buffer", p->label,
                        operand ? "operand" : "result", operand ? i : i - p->operands);
        const XLA_FFI_Buffer *b = buffer_at(frame, p, i);
        int64_t bytes = element_bytes(b->dtype);
        for (int64_t d = 0; d < b->rank && bytes >= 0; ++d) bytes *= b->dims[d];
        if ((int64_t)b->dtype != p->dtype[i] || bytes != (int64_t)p->nbytes[i])
            return fail(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "fmha_rt %s: buffer %zu has dtype %d and %lld "
                        "bytes, its launch program was built for dtype %lld and %llu bytes", p->label, i,
                        (int)b->dtype, (long long)bytes, (long long)p->dtype[i], (unsigned long long)p->nbytes[i]);
    }
    return NULL;
}

/* The device XLA runs the call on; the thread's current device where this XLA lacks the query. */
static int call_device(const XLA_FFI_Api *api, const XLA_FFI_CallFrame *frame, int *device) {
    size_t needed = offsetof(XLA_FFI_Api, XLA_FFI_DeviceOrdinal_Get) + sizeof api->XLA_FFI_DeviceOrdinal_Get;
    if (api->struct_size >= needed && api->XLA_FFI_DeviceOrdinal_Get != NULL) {
        XLA_FFI_DeviceOrdinal_Get_Args args = {XLA_FFI_DeviceOrdinal_Get_Args_STRUCT_SIZE, NULL, frame->ctx, -1};
        XLA_FFI_Error *error = api->XLA_FFI_DeviceOrdinal_Get(&args);
        if (error == NULL) {
            *device = args.device_ordinal;
            return FMHA_OK;
        }
        drop_error(api, error);
    }
    return fmha_current_device(device);
}

/* ---- running it ---- */

/* The program as a replay (replay.c, the executor of cached calls too): the call's buffer addresses
   are its values, each patch a buffer plus an offset, each zero fill a region of a buffer. The replay
   checks every pointer's alignment before the first write to device memory, so a refused call leaves
   the outputs and the workspace untouched. */
static XLA_FFI_Error *run(const XLA_FFI_Api *api, XLA_FFI_CallFrame *frame, const program *p) {
    XLA_FFI_Error *error = check_buffers(api, frame, p);
    if (error) return error;
    if (fmha_backend() == 0)
        return fail(api, XLA_FFI_Error_Code_FAILED_PRECONDITION, "fmha_rt %s: the GPU runtime of the shim is not "
                    "initialised in this process (the program was built elsewhere: trace the call here first)", p->label);
    XLA_FFI_Stream_Get_Args stream_args = {XLA_FFI_Stream_Get_Args_STRUCT_SIZE, NULL, frame->ctx, NULL};
    if ((error = api->XLA_FFI_Stream_Get(&stream_args)) != NULL) {
        drop_error(api, error);
        return fail(api, XLA_FFI_Error_Code_FAILED_PRECONDITION, "fmha_rt %s: XLA gives no GPU stream for this "
                    "call (is it compiled for a GPU platform?)", p->label);
    }
    uint64_t stream = (uint64_t)(uintptr_t)stream_args.stream;
    int device = -1;
    if (call_device(api, frame, &device) != FMHA_OK || device < 0)
        return fail(api, XLA_FFI_Error_Code_INTERNAL, "fmha_rt %s: cannot tell which device XLA runs the call on "
                    "(%s)", p->label, fmha_last_error());

    uint64_t values[MAX_BUFFERS];
    for (size_t i = 0; i < p->operands + p->results; ++i) values[i] = (uint64_t)(uintptr_t)buffer_at(frame, p, i)->data;
    fmha_replay_fill fills[MAX_BUFFERS];
    for (size_t i = 0; i < p->fill_count; ++i) {
        const zero_fill *f = &p->fills[i];
        if (f->offset > p->nbytes[f->buffer] || f->nbytes > p->nbytes[f->buffer] - f->offset)
            return fail(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "fmha_rt %s: a zeroed region [%llu, +%llu) lies "
                        "outside buffer %zu", p->label, (unsigned long long)f->offset,
                        (unsigned long long)f->nbytes, f->buffer);
        fills[i] = (fmha_replay_fill){(uint32_t)f->buffer, f->offset, f->nbytes};
    }
    fmha_launch_config launches[MAX_LAUNCHES];
    fmha_replay_patch patches[MAX_PATCHES];
    size_t patch_count = 0;
    for (size_t i = 0; i < p->launch_count; ++i) {
        const launch *l = &p->launches[i];
        fmha_kernel *kernel;
        if (fmha_image_kernel(device, l->key, &kernel) != FMHA_OK)
            return fail(api, XLA_FFI_Error_Code_INTERNAL, "fmha_rt %s: kernel '%s' on device %d: %s", p->label,
                        l->key, device, fmha_last_error());
        launches[i] = (fmha_launch_config){kernel, {l->grid[0], l->grid[1], l->grid[2]},
                                           {l->block[0], l->block[1], l->block[2]}, l->shared_bytes,
                                           (void *)l->template_bytes, l->args_size};
        for (size_t j = l->first_patch; j < l->first_patch + l->patch_count; ++j, ++patch_count) {
            const patch *pt = &p->patches[j];
            if (pt->offset > p->nbytes[pt->buffer])
                return fail(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "fmha_rt %s: kernel '%s': the pointer at "
                            "argument byte %zu (buffer %zu + %llu) is outside its buffer", p->label, l->key,
                            pt->arg_offset, pt->buffer, (unsigned long long)pt->offset);
            patches[patch_count] = (fmha_replay_patch){(uint32_t)i, (uint32_t)pt->arg_offset, (uint32_t)pt->buffer,
                                                       pt->align, pt->offset};
        }
    }
    fmha_replay_plan plan = {device, p->launch_count, launches, patch_count, patches, 0, NULL, p->fill_count, fills,
                             0, 0, (uint32_t)(p->operands + p->results)};
    size_t failed = 0;
    int status = fmha_replay(&plan, fmha_replay_native_ops(), values, stream, 0, &failed);
    if (status == FMHA_OK) return NULL;
    if (status == FMHA_ERR_MISALIGNED) {
        const fmha_replay_patch *pt = &patches[failed];
        return fail(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "fmha_rt %s: kernel '%s' on device %d: the pointer at "
                    "argument byte %u (buffer %u + %llu = 0x%llx) is not %u-byte aligned", p->label,
                    p->launches[pt->launch].key, device, pt->arg_offset, pt->value, (unsigned long long)pt->addend,
                    (unsigned long long)(values[pt->value] + pt->addend), pt->align);
    }
    if (failed < p->fill_count)
        return fail(api, XLA_FFI_Error_Code_INTERNAL, "fmha_rt %s: zeroing the workspace on device %d: %s", p->label,
                    device, fmha_last_error());
    return fail(api, XLA_FFI_Error_Code_INTERNAL, "fmha_rt %s: kernel '%s' on device %d: %s", p->label,
                p->launches[failed - p->fill_count].key, device, fmha_last_error());
}

XLA_FFI_Error *fmha_xla_run_program(XLA_FFI_CallFrame *frame) {
    if (answer_metadata(frame)) return NULL;
    const XLA_FFI_Api *api = frame->api;
    if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL; /* registered for execution only */
    const XLA_FFI_Array *attribute = program_attribute(frame);
    if (attribute == NULL)
        return fail(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "fmha_rt: the custom call has no int64 array "
                    "attribute '%s' (call it through fmha_rt.jax)", PROGRAM_ATTRIBUTE);
    program *p = malloc(sizeof *p);
    XLA_FFI_Error *error = NULL;
    const char *malformed = NULL;
    if (p == NULL)
        error = fail(api, XLA_FFI_Error_Code_RESOURCE_EXHAUSTED, "fmha_rt: out of host memory");
    else if ((malformed = decode(attribute->data, attribute->size, p)) != NULL)
        error = fail(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "fmha_rt: the launch program is malformed: %s",
                     malformed);
    else
        error = run(api, frame, p);
    free(p);
    return error;
}
