/* Describing a call's torch tensors for the plan cache in one C call (include/fmha_rt.h, block
   "describing a call's torch tensors").

   Reading shape, stride(), dtype and device of five tensors from Python costs ~1 µs per tensor;
   the framework's DLPack C exchange API fills a DLTensor per tensor without creating any Python
   object. The shim is built for the stable ABI, so only limited-API calls are used here.

   The describing is a Python builtin (METH_FASTCALL) rather than a cffi function: it runs on every
   plan-cache hit, and a cffi call would release the GIL only for this file to take it back, and
   would hand the words over in a buffer Python then copies into the key's bytes; the builtin keeps
   the GIL and returns those bytes itself. */
#define Py_LIMITED_API 0x030A0000
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

static const char CAPSULE_NAME[] = "fmha_rt.describer";
static PyObject *describe_function(PyObject *capsule, PyObject *const *args, Py_ssize_t nargs);
static PyMethodDef describe_method = {"describe", (PyCFunction)(void (*)(void))describe_function, METH_FASTCALL,
                                      "describe(objects, addresses, capacity) -> bytes or None"};

static void free_copy(PyObject *capsule) { PyMem_Free(PyCapsule_GetPointer(capsule, CAPSULE_NAME)); }

/* The builtin, bound to a copy of `d` that it owns, stored as "describe" in the dict `namespace`. */
static int put_function(const fmha_describer *d, PyObject *namespace) {
    fmha_describer *copy = PyMem_Malloc(sizeof *copy);
    if (copy == NULL) return -1;
    *copy = *d;
    PyObject *capsule = PyCapsule_New(copy, CAPSULE_NAME, free_copy);
    if (capsule == NULL) {
        PyMem_Free(copy);
        return -1;
    }
    PyObject *function = PyCFunction_NewEx(&describe_method, capsule, NULL);
    Py_DECREF(capsule);
    int status = function != NULL && PyDict_Check(namespace) ? PyDict_SetItemString(namespace, "describe", function) : -1;
    Py_XDECREF(function);
    return status;
}

int fmha_describer_init(fmha_describer *d, uintptr_t tensor_type, uintptr_t second_type, uintptr_t namespace) {
    if (d == NULL || tensor_type == 0 || namespace == 0) return FMHA_ERR_BAD_ARGUMENT;
    memset(d, 0, sizeof *d);
    PyGILState_STATE gil = PyGILState_Ensure(); /* cffi released it */
    int status = FMHA_ERR_NO_SYMBOL;
    PyObject *capsule = PyObject_GetAttrString((PyObject *)tensor_type, "__dlpack_c_exchange_api__");
    const dl_exchange_api *api = capsule ? PyCapsule_GetPointer(capsule, "dlpack_exchange_api") : NULL;
    PyObject *is_neg = PyObject_GetAttrString((PyObject *)tensor_type, "is_neg"); /* the unbound method */
    if (api != NULL && api->major == 1 && api->minor >= 3 && api->dltensor_from_object != NULL && is_neg != NULL) {
        d->types[0] = tensor_type;
        d->types[1] = second_type;
        d->export_fn = (uintptr_t)api->dltensor_from_object;
        d->is_neg = (uintptr_t)is_neg; /* a reference kept for the life of the process */
        status = put_function(d, (PyObject *)namespace) == 0 ? FMHA_OK : FMHA_ERR_OUT_OF_MEMORY;
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

/* The words of the items of `tuple` (at most FMHA_DESCRIBE_MAX_ARRAYS), their addresses and zeros after
   them up to `address_capacity`; 0 when one of them cannot be described exactly (no error left set). */
static size_t describe_items(const fmha_describer *d, PyObject *tuple, int64_t *words, uint64_t *addresses,
                             size_t address_capacity) {
    dl_tensor_from_object export_tensor = (dl_tensor_from_object)d->export_fn;
    Py_ssize_t count = PyTuple_Check(tuple) ? PyTuple_Size(tuple) : -1;
    if (count < 0 || count > FMHA_DESCRIBE_MAX_ARRAYS || (size_t)count > address_capacity) goto refuse;
    size_t n = 0;
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
    for (size_t i = (size_t)count; i < address_capacity; i++) addresses[i] = 0;
    return n;
refuse:
    PyErr_Clear();
    return 0;
}

/* describe(objects, addresses, capacity): the words of the tuple `objects` as bytes (equal bytes mean
   equal signatures), their data addresses written to the uint64 array at the int `addresses` and zeros
   after them up to `capacity` entries; None when an item cannot be described exactly. */
static PyObject *describe_function(PyObject *capsule, PyObject *const *args, Py_ssize_t nargs) {
    const fmha_describer *d = PyCapsule_GetPointer(capsule, CAPSULE_NAME);
    if (d == NULL) return NULL;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "describe(objects, addresses, capacity) takes 3 arguments");
        return NULL;
    }
    uint64_t *addresses = PyLong_AsVoidPtr(args[1]);
    size_t capacity = PyLong_AsSize_t(args[2]);
    if (PyErr_Occurred()) return NULL;
    if (addresses == NULL) {
        PyErr_SetString(PyExc_ValueError, "describe: addresses is NULL");
        return NULL;
    }
    int64_t words[FMHA_DESCRIBE_MAX_ARRAYS * FMHA_DESCRIBE_WORDS_PER_ARRAY];
    size_t n = describe_items(d, args[0], words, addresses, capacity);
    if (n == 0) Py_RETURN_NONE;
    return PyBytes_FromStringAndSize((const char *)words, (Py_ssize_t)(n * sizeof *words));
}
