/*
 * fmha_rt's XLA FFI handler: runs a launch program on the stream and device that XLA hands over.
 *
 * A launch program (built at trace time by fmha_rt/replay/xla_program.py in the format of
 * fmha_rt/replay/program.py, and loaded by program.c as the plan cache's are) is an int64 array
 * attribute of the custom call: the buffers the call must receive, the workspace
 * regions to zero, and per launch the kernel key, grid, block, shared memory, the packed argument
 * template and the pointer slots to fill with buffer addresses. Everything the handler needs is in
 * the program, the call's buffers and the shim (kernel images registered at trace time, the kernel
 * map, and fmha_replay, which runs the plan-cache hits of the Python API too), so it never calls into
 * Python and never takes the GIL.
 *
 * Written against XLA's C FFI API (xla/ffi/api/c_api.h from jaxlib) and nothing else of XLA's.
 */
#include "program.h"

#include "xla/ffi/api/c_api.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define PROGRAM_ATTRIBUTE "program"

void fmha_xla_ffi_api_version(int *major, int *minor) {
    *major = XLA_FFI_API_MAJOR;
    *minor = XLA_FFI_API_MINOR;
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

static const XLA_FFI_Buffer *buffer_at(const XLA_FFI_CallFrame *frame, const fmha_program *p, size_t i) {
    return i < p->operands ? frame->args.args[i] : frame->rets.rets[i - p->operands];
}

static XLA_FFI_Error *check_buffers(const XLA_FFI_Api *api, const XLA_FFI_CallFrame *frame, const fmha_program *p) {
    size_t results = p->value_count - p->operands;
    if (frame->args.size != (int64_t)p->operands || frame->rets.size != (int64_t)results)
        return fail(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "fmha_rt %s: the call has %lld operands and %lld "
                    "results, its launch program expects %zu and %zu", p->label, (long long)frame->args.size,
                    (long long)frame->rets.size, p->operands, results);
    for (size_t i = 0; i < p->value_count; ++i) {
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

/* The loaded program's replay (replay.c, the executor of cached calls too), with the call's buffer
   addresses as its values. The replay checks every pointer's alignment before the first write to
   device memory, so a refused call leaves the outputs and the workspace untouched. */
static XLA_FFI_Error *run(const XLA_FFI_Api *api, XLA_FFI_CallFrame *frame, fmha_program *p) {
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
    int device = -1;
    if (call_device(api, frame, &device) != FMHA_OK || device < 0)
        return fail(api, XLA_FFI_Error_Code_INTERNAL, "fmha_rt %s: cannot tell which device XLA runs the call on "
                    "(%s)", p->label, fmha_last_error());
    char why[512];
    if (fmha_program_bind(p, device, NULL, 0, why, sizeof why) != FMHA_OK)
        return fail(api, XLA_FFI_Error_Code_INTERNAL, "fmha_rt %s: %s", p->label, why);
    uint64_t values[MAX_VALUES];
    for (size_t i = 0; i < p->value_count; ++i) values[i] = (uint64_t)(uintptr_t)buffer_at(frame, p, i)->data;
    size_t failed = 0;
    int status = fmha_replay(&p->plan, fmha_replay_native_ops(), values, (uint64_t)(uintptr_t)stream_args.stream,
                             0, &failed);
    if (status == FMHA_ERR_MISALIGNED) {
        const fmha_replay_patch *pt = &p->patches[failed];
        return fail(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "fmha_rt %s: kernel '%s' on device %d: the pointer at "
                     "argument byte %u (buffer %u + %llu = 0x%llx) is not %u-byte aligned", p->label,
                     p->keys[pt->launch], device, pt->arg_offset, pt->value, (unsigned long long)pt->addend,
                     (unsigned long long)(values[pt->value] + pt->addend), pt->align);
    }
    if (status == FMHA_OK) return NULL;
    if (failed < p->plan.fill_count)
        return fail(api, XLA_FFI_Error_Code_INTERNAL, "fmha_rt %s: zeroing the workspace on device %d: %s", p->label,
                    device, fmha_last_error());
    return fail(api, XLA_FFI_Error_Code_INTERNAL, "fmha_rt %s: kernel '%s' on device %d: %s", p->label,
                p->keys[failed - p->plan.fill_count], device, fmha_last_error());
}

XLA_FFI_Error *fmha_xla_run_program(XLA_FFI_CallFrame *frame) {
    if (answer_metadata(frame)) return NULL;
    const XLA_FFI_Api *api = frame->api;
    if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL; /* registered for execution only */
    const XLA_FFI_Array *attribute = program_attribute(frame);
    if (attribute == NULL)
        return fail(api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "fmha_rt: the custom call has no int64 array "
                    "attribute '%s' (call it through fmha_rt.jax)", PROGRAM_ATTRIBUTE);
    fmha_program *p = NULL;
    char why[512];
    int status = fmha_program_load(attribute->data, attribute->size, &p, why, sizeof why);
    if (status != FMHA_OK)
        return fail(api, status == FMHA_ERR_OUT_OF_MEMORY ? XLA_FFI_Error_Code_RESOURCE_EXHAUSTED
                                                          : XLA_FFI_Error_Code_INVALID_ARGUMENT, "fmha_rt: %s", why);
    XLA_FFI_Error *error = run(api, frame, p);
    fmha_program_free(p);
    return error;
}
