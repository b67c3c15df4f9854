/* Describing a call's arrays for the plan cache in one C call (include/fmha_rt.h, block "describing a
   call's arrays").

   Reading shape, stride(), dtype and device of five tensors from Python costs ~1 µs per tensor, and a
   DLPack round trip of any other array ~30 µs; torch's DLPack C exchange API fills a DLTensor per
   tensor without creating any Python object, and the CUDA Array Interface is one dict per array,
   read here without building anything else. The shim is built for the stable ABI, so only
   limited-API calls are used here.

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

enum { KIND_TORCH = 1, KIND_INTERFACE = 2, KIND_CUPY = 3 };   /* the first byte of an array's words */
enum { DL_INT = 0, DL_UINT = 1, DL_FLOAT = 2, DL_BOOL = 6 };  /* DLPack type codes */
enum { DL_CUDA = 2, DL_ROCM = 10 };                           /* DLPack device types */

static const char CAPSULE_NAME[] = "fmha_rt.describer";
static PyObject *describe_function(PyObject *capsule, PyObject *const *args, Py_ssize_t nargs);
static PyMethodDef describe_method = {"describe", (PyCFunction)(void (*)(void))describe_function, METH_FASTCALL,
                                      "describe(objects, addresses, capacity, stream) -> bytes or None"};

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

/* The interface's entry names, made once; interned, so that dict lookups match them by address. */
static struct {
    PyObject *interface, *version, *shape, *typestr, *data, *strides, *stream, *mask; /* and CuPy's attributes: */
    PyObject *dtype, *kind, *itemsize, *ptr, *device_id;
} g_names;

static int make_names(void) {
    PyObject **names[] = {&g_names.interface, &g_names.version, &g_names.shape, &g_names.typestr,
                          &g_names.data,      &g_names.strides, &g_names.stream, &g_names.mask,
                          &g_names.dtype,     &g_names.kind,    &g_names.itemsize, &g_names.ptr,
                          &g_names.device_id};
    static const char *const texts[] = {"__cuda_array_interface__", "version", "shape", "typestr",
                                        "data", "strides", "stream", "mask", "dtype", "kind", "itemsize", "ptr",
                                        "device_id"};
    for (size_t i = 0; i < sizeof texts / sizeof *texts; i++)
        if (*names[i] == NULL && (*names[i] = PyUnicode_InternFromString(texts[i])) == NULL) return -1;
    return 0;
}

/* The exchange API of torch's tensor type into `d`, when it has a usable one (DLPack >= 1.3). */
static void find_exchange(fmha_describer *d, PyObject *tensor_type) {
    PyObject *capsule = PyObject_GetAttrString(tensor_type, "__dlpack_c_exchange_api__");
    const dl_exchange_api *api = capsule ? PyCapsule_GetPointer(capsule, "dlpack_exchange_api") : NULL;
    PyObject *is_neg = PyObject_GetAttrString(tensor_type, "is_neg"); /* the unbound method */
    if (api != NULL && api->major == 1 && api->minor >= 3 && api->dltensor_from_object != NULL && is_neg != NULL) {
        d->export_fn = (uintptr_t)api->dltensor_from_object;
        d->is_neg = (uintptr_t)is_neg; /* a reference kept for the life of the process */
    } else {
        Py_XDECREF(is_neg);
    }
    Py_XDECREF(capsule);
}

int fmha_describer_init(fmha_describer *d, const fmha_replay_ops *ops, uintptr_t tensor_type, uintptr_t second_type,
                        uintptr_t cupy_type, int cupy_device_type, uintptr_t namespace) {
    if (d == NULL || ops == NULL || namespace == 0) return FMHA_ERR_BAD_ARGUMENT;
    memset(d, 0, sizeof *d);
    PyGILState_STATE gil = PyGILState_Ensure(); /* cffi released it */
    d->ops = ops;
    d->types[0] = tensor_type;
    d->types[1] = second_type;
    d->cupy_type = cupy_type;
    d->cupy_device_type = cupy_device_type;
    if (tensor_type != 0) find_exchange(d, (PyObject *)tensor_type);
    PyErr_Clear();
    int status = make_names() == 0 && put_function(d, (PyObject *)namespace) == 0 ? FMHA_OK : FMHA_ERR_OUT_OF_MEMORY;
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

/* One array's words: a header (kind, rank, dtype, device type), the device ordinal, the `extra` words
   of its kind, the shape and the strides in elements (NULL strides: compact row-major, as DLPack and
   the interface both spell it). */
static size_t describe_tensor(int kind, const dl_tensor *t, const int64_t *extra, size_t extra_count, int64_t *words) {
    size_t n = 0;
    words[n++] = kind | (int64_t)t->ndim << 8 | (int64_t)t->code << 16 | (int64_t)t->bits << 24
                 | (int64_t)t->lanes << 32 | (int64_t)t->device_type << 48;
    words[n++] = t->device_id;
    for (size_t i = 0; i < extra_count; i++) words[n++] = extra[i];
    for (int i = 0; i < t->ndim; i++) words[n++] = t->shape[i];
    int64_t compact = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        words[n + i] = t->strides != NULL ? t->strides[i] : compact;
        compact *= t->shape[i];
    }
    return n + (size_t)t->ndim;
}

static size_t describe_torch(const fmha_describer *d, PyObject *item, int64_t *words, uint64_t *address) {
    dl_tensor t;
    dl_tensor_from_object export_tensor = (dl_tensor_from_object)d->export_fn;
    if (export_tensor == NULL || export_tensor(item, &t) != 0 || t.ndim < 0 || t.ndim > FMHA_DESCRIBE_MAX_NDIM)
        return 0;
    if (is_negated(d, item) != 0) return 0;
    *address = (uint64_t)(uintptr_t)t.data + t.byte_offset;
    return describe_tensor(KIND_TORCH, &t, NULL, 0, words);
}

/* ---- the CUDA Array Interface ---- */

/* Where one pointer of the call lives, as the driver said. */
typedef struct {
    uint64_t ptr;
    int device_type, device, memory_type;
} location;

/* A producer's stream the call's stream must wait for (a driver handle on that device). */
typedef struct {
    int device;
    uint64_t stream;
} producer;

/* What describing one call gathers besides the words. */
typedef struct {
    const fmha_describer *d;
    uint64_t stream; /* the call's */
    location places[FMHA_DESCRIBE_MAX_ARRAYS];
    size_t place_count;
    producer waits[FMHA_DESCRIBE_MAX_ARRAYS];
    size_t wait_count;
    int cupy_stream_read; /* the call's CuPy arrays' producer stream is known: */
    uint64_t cupy_stream;
} call_state;

/* Types of described interface arrays, kept alive: a key holds a type's address, and a type freed
   and another made at its address would otherwise meet the first one's plans. */
static PyObject *g_types[FMHA_DESCRIBE_MAX_TYPES];
static size_t g_type_count;

static int keep_type(PyObject *type) {
    for (size_t i = 0; i < g_type_count; i++)
        if (g_types[i] == type) return 0;
    if (g_type_count == FMHA_DESCRIBE_MAX_TYPES) return -1;
    Py_INCREF(type);
    g_types[g_type_count++] = type;
    return 0;
}

/* An entry of the interface's dict (borrowed), NULL when absent. */
static PyObject *entry(PyObject *interface, PyObject *name) { return PyDict_GetItemWithError(interface, name); }

/* An int exactly (bools and other int subclasses are refused) in [0, 2^63). */
static int read_count(PyObject *o, int64_t *out) {
    if (o == NULL || !PyLong_CheckExact(o)) return -1;
    long long v = PyLong_AsLongLong(o);
    if (v < 0) return -1; /* also an overflow's -1 */
    *out = v;
    return 0;
}

/* DLPack code and bits of a type: little-endian floats of 2, 4 or 8 bytes, ints and unsigned ints of
   1, 2, 4 or 8, and bool (1 byte). Anything else is refused. */
static int parse_type(char kind, int64_t size, uint8_t *code, uint8_t *bits) {
    int sized = size == 1 || size == 2 || size == 4 || size == 8;
    switch (kind) {
    case 'f': *code = DL_FLOAT; break;
    case 'i': *code = DL_INT; break;
    case 'u': *code = DL_UINT; break;
    case 'b': *code = DL_BOOL; break;
    default: return -1;
    }
    if (!sized || (*code == DL_FLOAT && size == 1) || (*code == DL_BOOL && size != 1)) return -1;
    *bits = (uint8_t)(8 * size);
    return 0;
}

/* A typestr's type: '<' (or '|' for one byte), the kind, the size in bytes. Another byte order, complex
   numbers and void types are refused; void is how bfloat16 reads ("<V2", no different from any other
   two bytes). */
static int read_typestr(PyObject *typestr, uint8_t *code, uint8_t *bits) {
    Py_ssize_t n = 0;
    const char *s = typestr != NULL && PyUnicode_Check(typestr) ? PyUnicode_AsUTF8AndSize(typestr, &n) : NULL;
    if (s == NULL || n != 3 || !(s[0] == '<' || (s[0] == '|' && s[2] == '1'))) return -1;
    return parse_type(s[1], s[2] - '0', code, bits);
}

static int read_shape(PyObject *shape, dl_tensor *t) {
    Py_ssize_t ndim = shape != NULL && PyTuple_Check(shape) ? PyTuple_Size(shape) : -1;
    if (ndim < 0 || ndim > FMHA_DESCRIBE_MAX_NDIM) return -1;
    t->ndim = (int32_t)ndim;
    for (Py_ssize_t i = 0; i < ndim; i++)
        if (read_count(PyTuple_GetItem(shape, i), &t->shape[i]) != 0) return -1;
    return 0;
}

/* Byte strides (None or absent: compact, left NULL) as element strides; none negative, each a whole
   number of elements. */
static int read_strides(PyObject *strides, dl_tensor *t) {
    if (strides == NULL || strides == Py_None) {
        t->strides = NULL;
        return 0;
    }
    if (!PyTuple_Check(strides) || PyTuple_Size(strides) != t->ndim) return -1;
    int64_t itemsize = t->bits / 8;
    for (int i = 0; i < t->ndim; i++) {
        if (read_count(PyTuple_GetItem(strides, i), &t->strides[i]) != 0 || t->strides[i] % itemsize) return -1;
        t->strides[i] /= itemsize;
    }
    return 0;
}

/* data: (pointer, read-only flag as a bool). */
static int read_data(PyObject *data, uint64_t *ptr, int *read_only) {
    if (data == NULL || !PyTuple_Check(data) || PyTuple_Size(data) != 2) return -1;
    PyObject *address = PyTuple_GetItem(data, 0), *flag = PyTuple_GetItem(data, 1);
    if (!PyLong_CheckExact(address) || !PyBool_Check(flag)) return -1;
    *ptr = PyLong_AsUnsignedLongLong(address);
    *read_only = flag == Py_True;
    return PyErr_Occurred() ? -1 : 0;
}

/* stream: absent or None (nothing to wait for: *stream 0), else the producer's stream, an int that
   is not 0. */
static int read_stream(PyObject *value, uint64_t *stream) {
    *stream = 0;
    if (value == NULL || value == Py_None) return 0;
    if (!PyLong_CheckExact(value)) return -1;
    *stream = PyLong_AsUnsignedLongLong(value);
    return PyErr_Occurred() || *stream == 0 ? -1 : 0;
}

/* Where `ptr` lives, asked of the driver once per distinct pointer of the call (the answer is never
   kept across calls: freed memory's addresses come back, possibly on another device). NULL, an empty
   array's pointer, lives nowhere to ask about. */
static const location *locate(call_state *c, uint64_t ptr) {
    if (ptr == 0) return NULL;
    for (size_t i = 0; i < c->place_count; i++)
        if (c->places[i].ptr == ptr) return &c->places[i];
    location *l = &c->places[c->place_count];
    l->ptr = ptr;
    if (c->d->ops->pointer_location(ptr, &l->device_type, &l->device, &l->memory_type) != FMHA_OK) return NULL;
    c->place_count++;
    return l;
}

/* The interface's stream value as the driver's handle on a device of `device_type`: 1 (the legacy
   default stream) is CUDA's CU_STREAM_LEGACY, 1, and ROCm's null stream, 0; 2 (the per-thread default
   stream) is both drivers' own 2; anything else is a stream's handle. */
static uint64_t producer_handle(int device_type, uint64_t stream) {
    return device_type == DL_ROCM && stream == 1 ? 0 : stream;
}

/* The producer handle that names the call's stream: on CUDA the shim launches on 0, the NULL stream,
   which its driver entry points (not the per-thread ones) take as the legacy default stream, 1. */
static uint64_t call_handle(int device_type, uint64_t stream) {
    return device_type == DL_CUDA && stream == 0 ? 1 : stream;
}

/* Note that the call's stream waits for `stream` of the array at `where`, unless it is the call's
   stream itself or noted already. */
static void note_producer(call_state *c, const location *where, uint64_t stream) {
    producer p = {where->device, producer_handle(where->device_type, stream)};
    if (p.stream == call_handle(where->device_type, c->stream)) return;
    for (size_t i = 0; i < c->wait_count; i++)
        if (c->waits[i].device == p.device && c->waits[i].stream == p.stream) return;
    c->waits[c->wait_count++] = p;
}

static size_t read_interface(call_state *c, PyObject *item, PyObject *interface, int64_t *words, uint64_t *address) {
    int64_t shape[FMHA_DESCRIBE_MAX_NDIM], strides[FMHA_DESCRIBE_MAX_NDIM], version = 0;
    dl_tensor t = {.lanes = 1, .shape = shape, .strides = strides};
    PyObject *mask = entry(interface, g_names.mask);
    uint64_t ptr = 0, stream = 0;
    int read_only = 0;
    if (read_count(entry(interface, g_names.version), &version) != 0 || version != 3 || (mask != NULL && mask != Py_None) ||
        read_typestr(entry(interface, g_names.typestr), &t.code, &t.bits) != 0 ||
        read_shape(entry(interface, g_names.shape), &t) != 0 || read_strides(entry(interface, g_names.strides), &t) != 0 ||
        read_data(entry(interface, g_names.data), &ptr, &read_only) != 0 ||
        read_stream(entry(interface, g_names.stream), &stream) != 0 || PyErr_Occurred())
        return 0;
    const location *where = locate(c, ptr);
    if (where == NULL || keep_type((PyObject *)Py_TYPE(item)) != 0) return 0;
    if (stream != 0) note_producer(c, where, stream);
    t.device_type = where->device_type;
    t.device_id = where->device;
    *address = ptr;
    int64_t extra[2] = {(int64_t)(uint32_t)where->memory_type | (int64_t)read_only << 32, (int64_t)(uintptr_t)Py_TYPE(item)};
    return describe_tensor(KIND_INTERFACE, &t, extra, 2, words);
}

static size_t describe_interface(call_state *c, PyObject *item, int64_t *words, uint64_t *address) {
    PyObject *interface = PyObject_GetAttr(item, g_names.interface);
    size_t n = interface != NULL && PyDict_CheckExact(interface) ? read_interface(c, item, interface, words, address) : 0;
    Py_XDECREF(interface);
    return n;
}

/* ---- CuPy arrays, from their attributes ---- */

/* The producer stream of the call's CuPy arrays: their interface's stream entry, which CuPy fills with
   its current stream (None when CUPY_CUDA_ARRAY_INTERFACE_SYNC is off), the same for every array of
   the call; so one array's interface dict is made per call, not one per array. */
static int cupy_stream(call_state *c, PyObject *item) {
    if (c->cupy_stream_read) return 0;
    PyObject *interface = PyObject_GetAttr(item, g_names.interface);
    int64_t version = 0;
    int ok = interface != NULL && PyDict_CheckExact(interface) &&
             read_count(entry(interface, g_names.version), &version) == 0 && version == 3 &&
             read_stream(entry(interface, g_names.stream), &c->cupy_stream) == 0 && !PyErr_Occurred();
    Py_XDECREF(interface);
    c->cupy_stream_read = ok;
    return ok ? 0 : -1;
}

/* The DLPack type of a NumPy dtype from its kind and itemsize, remembered for the first
   FMHA_DESCRIBE_MAX_TYPES dtypes seen (referenced from then on, so that an address stays one dtype;
   NumPy's builtin dtypes are singletons anyway): the two reads cost about what the rest of an array's
   description does. The GIL guards the table. */
static struct {
    PyObject *dtype;
    uint8_t code, bits;
} g_dtypes[FMHA_DESCRIBE_MAX_TYPES];
static size_t g_dtype_count;

static int read_dtype(PyObject *dtype, uint8_t *code, uint8_t *bits) {
    if (dtype == NULL) return -1;
    for (size_t i = 0; i < g_dtype_count; i++)
        if (g_dtypes[i].dtype == dtype) {
            *code = g_dtypes[i].code;
            *bits = g_dtypes[i].bits;
            return 0;
        }
    PyObject *kind = PyObject_GetAttr(dtype, g_names.kind), *itemsize = PyObject_GetAttr(dtype, g_names.itemsize);
    Py_ssize_t n = 0;
    const char *k = kind != NULL && PyUnicode_Check(kind) ? PyUnicode_AsUTF8AndSize(kind, &n) : NULL;
    int64_t size = 0;
    int status = k != NULL && n == 1 && read_count(itemsize, &size) == 0 ? parse_type(k[0], size, code, bits) : -1;
    Py_XDECREF(kind);
    Py_XDECREF(itemsize);
    if (status == 0 && g_dtype_count < FMHA_DESCRIBE_MAX_TYPES) {
        Py_INCREF(dtype);
        g_dtypes[g_dtype_count].dtype = dtype;
        g_dtypes[g_dtype_count].code = *code;
        g_dtypes[g_dtype_count++].bits = *bits;
    }
    return status;
}

/* A CuPy array (exactly cupy.ndarray) from its documented attributes: shape, strides (bytes), dtype
   (read_dtype: CuPy's dtypes are native, little-endian on every host it runs on; dtype.str would cost
   more than the rest together), data.ptr and data.device_id, which names the device without asking
   the driver. Its interface dict (~1.1-1.5 µs for CuPy to make) and the driver's pointer query (~0.5-0.7
   µs) per array were most of a CuPy call's key (NOTES.md, host v10). */
static size_t describe_cupy(call_state *c, PyObject *item, int64_t *words, uint64_t *address) {
    if (cupy_stream(c, item) != 0) return 0;
    int64_t shape[FMHA_DESCRIBE_MAX_NDIM], strides[FMHA_DESCRIBE_MAX_NDIM], device = 0;
    dl_tensor t = {.lanes = 1, .shape = shape, .strides = strides, .device_type = c->d->cupy_device_type};
    PyObject *dims = PyObject_GetAttr(item, g_names.shape), *steps = PyObject_GetAttr(item, g_names.strides);
    PyObject *dtype = PyObject_GetAttr(item, g_names.dtype), *data = PyObject_GetAttr(item, g_names.data);
    PyObject *ptr = data != NULL ? PyObject_GetAttr(data, g_names.ptr) : NULL;
    PyObject *ordinal = data != NULL ? PyObject_GetAttr(data, g_names.device_id) : NULL;
    int ok = read_dtype(dtype, &t.code, &t.bits) == 0 && read_shape(dims, &t) == 0 && read_strides(steps, &t) == 0 &&
             read_count(ordinal, &device) == 0 && device <= INT32_MAX && ptr != NULL && PyLong_CheckExact(ptr);
    *address = ok ? PyLong_AsUnsignedLongLong(ptr) : 0;
    ok = ok && !PyErr_Occurred() && *address != 0; /* an empty array's NULL: described another way */
    PyObject *refs[] = {dims, steps, dtype, data, ptr, ordinal};
    for (size_t i = 0; i < sizeof refs / sizeof *refs; i++) Py_XDECREF(refs[i]);
    if (!ok) return 0;
    t.device_id = (int32_t)device;
    if (c->cupy_stream != 0) {
        location where = {*address, t.device_type, t.device_id, 0};
        note_producer(c, &where, c->cupy_stream);
    }
    return describe_tensor(KIND_CUPY, &t, NULL, 0, words);
}

/* The call's stream made to wait for every producer noted. */
static int order_streams(const call_state *c) {
    for (size_t i = 0; i < c->wait_count; i++)
        if (fmha_stream_order(c->d->ops, c->waits[i].device, c->waits[i].stream, c->stream) != FMHA_OK) return -1;
    return 0;
}

/* ---- the builtin ---- */

static size_t describe_item(call_state *c, PyObject *item, int64_t *words, uint64_t *address) {
    if (item == Py_None) {
        words[0] = 0;
        *address = 0;
        return 1;
    }
    uintptr_t type = (uintptr_t)Py_TYPE(item);
    if (type == c->d->types[0] || type == c->d->types[1]) return describe_torch(c->d, item, words, address);
    if (type == c->d->cupy_type) return describe_cupy(c, item, words, address);
    /* Another tensor subclass keeps the way it had: torch's interface is version 2, read in Python. */
    if (c->d->types[0] != 0 && PyType_IsSubtype(Py_TYPE(item), (PyTypeObject *)c->d->types[0])) return 0;
    return describe_interface(c, item, words, address);
}

/* The words of the items of `tuple` (at most FMHA_DESCRIBE_MAX_ARRAYS), their addresses and zeros after
   them up to `address_capacity`, the call's stream ordered after the producers; 0 when one of them
   cannot be described exactly (no error left set, nothing ordered). */
static size_t describe_items(const fmha_describer *d, PyObject *tuple, uint64_t stream, int64_t *words,
                             uint64_t *addresses, size_t address_capacity) {
    call_state c = {.d = d, .stream = stream};
    Py_ssize_t count = PyTuple_Check(tuple) ? PyTuple_Size(tuple) : -1;
    if (count < 0 || count > FMHA_DESCRIBE_MAX_ARRAYS || (size_t)count > address_capacity) goto refuse;
    size_t n = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        size_t described = describe_item(&c, PyTuple_GetItem(tuple, i), words + n, &addresses[i]);
        if (described == 0) goto refuse;
        n += described;
    }
    if (order_streams(&c) != 0) goto refuse;
    for (size_t i = (size_t)count; i < address_capacity; i++) addresses[i] = 0;
    return n;
refuse:
    PyErr_Clear();
    return 0;
}

/* describe(objects, addresses, capacity, stream): the words of the tuple `objects` as bytes (equal
   bytes mean equal signatures), their data addresses written to the uint64 array at the int
   `addresses` and zeros after them up to `capacity` entries, the call's `stream` ordered after the
   producers' that are not it; None when an item cannot be described exactly. */
static PyObject *describe_function(PyObject *capsule, PyObject *const *args, Py_ssize_t nargs) {
    const fmha_describer *d = PyCapsule_GetPointer(capsule, CAPSULE_NAME);
    if (d == NULL) return NULL;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "describe(objects, addresses, capacity, stream) takes 4 arguments");
        return NULL;
    }
    uint64_t *addresses = PyLong_AsVoidPtr(args[1]);
    size_t capacity = PyLong_AsSize_t(args[2]);
    uint64_t stream = PyLong_AsUnsignedLongLong(args[3]);
    if (PyErr_Occurred()) return NULL;
    if (addresses == NULL) {
        PyErr_SetString(PyExc_ValueError, "describe: addresses is NULL");
        return NULL;
    }
    int64_t words[FMHA_DESCRIBE_MAX_ARRAYS * FMHA_DESCRIBE_WORDS_PER_ARRAY];
    size_t n = describe_items(d, args[0], stream, words, addresses, capacity);
    if (n == 0) Py_RETURN_NONE;
    return PyBytes_FromStringAndSize((const char *)words, (Py_ssize_t)(n * sizeof *words));
}
