/* Describing a call's torch tensors for the plan cache in one C call (include/fmha_rt.h, block
   "describing a call's torch tensors").

   Reading shape, stride(), dtype and device of five tensors from Python costs ~1 µs per tensor;
   the framework's DLPack C exchange API fills a DLTensor per tensor without creating any Python
   object. The shim is built for the stable ABI, so only limited-API calls are used here. cffi
   releases the GIL around its calls: this file takes it back before touching Python objects. */
#define Py_LIMITED_API 0x03080000
#include <Python.h>

#include <string.h>

#include "fmha_rt.h"

/* DLPack's DLTensor, whose layout is part of DLPack's stable ABI since 0.x; declared here so that
   building the shim needs no framework headers. */
typedef struct {
    void *data;
    int32_t device_type, device_id;
    int32_t ndim;
    uint8_t code, bits;
    uint16_t lanes;
    int64_t *shape, *strides;
    uint64_t byte_offset;
} dl_tensor;

typedef int (*dl_tensor_from_object)(void *object, dl_tensor *out);

/* The exchange table: the stable header (version, previous table), then the DLPack 1.3 functions,
   of which the fourth fills a caller's DLTensor without taking ownership. */
typedef struct {
    uint32_t major, minor;
    void *previous;
    void *allocator, *managed_from_object, *managed_to_object;
    dl_tensor_from_object dltensor_from_object;
    void *current_work_stream;
} dl_exchange_api;

int fmha_describer_init(fmha_describer *d, uintptr_t tensor_type, uintptr_t second_type) {
    if (d == NULL || tensor_type == 0) return FMHA_ERR_BAD_ARGUMENT;
    memset(d, 0, sizeof *d);
    PyGILState_STATE gil = PyGILState_Ensure();
    int status = FMHA_ERR_NO_SYMBOL;
    PyObject *capsule = PyObject_GetAttrString((PyObject *)tensor_type, "__dlpack_c_exchange_api__");
    const dl_exchange_api *api = capsule ? PyCapsule_GetPointer(capsule, "dlpack_exchange_api") : NULL;
    PyObject *is_neg = PyObject_GetAttrString((PyObject *)tensor_type, "is_neg"); /* the unbound method */
    if (api != NULL && api->major == 1 && api->minor >= 3 && api->dltensor_from_object != NULL && is_neg != NULL) {
        d->types[0] = tensor_type;
        d->types[1] = second_type;
        d->export_fn = (uintptr_t)api->dltensor_from_object;
        d->is_neg = (uintptr_t)is_neg; /* a reference kept for the life of the process */
        status = FMHA_OK;
    } else {
        Py_XDECREF(is_neg);
    }
    Py_XDECREF(capsule);
    PyErr_Clear();
    PyGILState_Release(gil);
    return status;
}

/* Whether the tensor holds negated values lazily (torch's neg bit): DLPack exports such a view as
   if it were plain, so a plan recorded for a plain tensor would read the wrong sign. */
static int is_negated(const fmha_describer *d, PyObject *tensor) {
    PyObject *answer = PyObject_CallFunctionObjArgs((PyObject *)d->is_neg, tensor, NULL);
    int negated = answer == NULL ? -1 : PyObject_IsTrue(answer);
    Py_XDECREF(answer);
    return negated;
}

/* One tensor's words: a header (kind, rank, dtype, device type), the device ordinal, the shape and
   the strides in elements (DLPack leaves strides NULL for compact row-major tensors). */
static size_t describe_tensor(const dl_tensor *t, int64_t *words) {
    size_t n = 0;
    words[n++] = 1 | (int64_t)t->ndim << 8 | (int64_t)t->code << 16 | (int64_t)t->bits << 24
                 | (int64_t)t->lanes << 32 | (int64_t)t->device_type << 48;
    words[n++] = t->device_id;
    for (int i = 0; i < t->ndim; i++) words[n++] = t->shape[i];
    int64_t compact = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        words[n + i] = t->strides != NULL ? t->strides[i] : compact;
        compact *= t->shape[i];
    }
    return n + (size_t)t->ndim;
}

size_t fmha_describe(const fmha_describer *d, uintptr_t objects, int64_t *words, size_t word_capacity,
                     uint64_t *addresses, size_t address_capacity) {
    if (d == NULL || d->export_fn == 0 || objects == 0 || words == NULL || addresses == NULL) return 0;
    dl_tensor_from_object export_tensor = (dl_tensor_from_object)d->export_fn;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *tuple = (PyObject *)objects;
    Py_ssize_t count = PyTuple_Check(tuple) ? PyTuple_Size(tuple) : -1;
    size_t n = 0;
    if (count < 0 || (size_t)count > address_capacity || (size_t)count * FMHA_DESCRIBE_WORDS_PER_ARRAY > word_capacity)
        goto refuse;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyTuple_GetItem(tuple, i);
        if (item == Py_None) {
            words[n++] = 0;
            addresses[i] = 0;
            continue;
        }
        uintptr_t type = (uintptr_t)Py_TYPE(item);
        if (type != d->types[0] && (type != d->types[1] || type == 0)) goto refuse;
        dl_tensor t;
        if (export_tensor(item, &t) != 0 || t.ndim < 0 || t.ndim > FMHA_DESCRIBE_MAX_NDIM) goto refuse;
        if (is_negated(d, item) != 0) goto refuse;
        n += describe_tensor(&t, words + n);
        addresses[i] = (uint64_t)(uintptr_t)t.data + t.byte_offset;
    }
    PyGILState_Release(gil);
    return n;
refuse:
    PyErr_Clear();
    PyGILState_Release(gil);
    return 0;
}
