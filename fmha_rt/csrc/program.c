/*
 * Launch programs: the one form in which a call's launches reach the C replay (replay.c). The plan
 * cache (fmha_rt/replay/plan_cache.py) loads a program once per recorded signature and replays its
 * plan on every hit; the XLA FFI handler (xla_ffi.c) loads the program of its custom call's attribute
 * on every call. Loading decodes the wire words (a private copy: the templates point into it), checks
 * every count, offset and alignment against its limits, resolves each launch's kernel (the caller's
 * handles, or the images registered in the shim) and fills in the fmha_replay_plan.
 */
#include "program.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

static int64_t read_range(reader *r, int64_t lo, int64_t hi) {
    int64_t v = read_word(r);
    if (v < lo || v > hi) {
        r->bad = 1;
        return lo < 0 && hi >= 0 ? 0 : lo;
    }
    return v;
}

/* Bytes: their length, then the bytes packed eight to a word in memory order (the program is built
   on a little-endian host for a little-endian host). Returns a pointer into the words. */
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

/* A byte range [offset, offset + nbytes) of value `value` that must lie inside it, where its size is known. */
static int outside(const fmha_program *p, size_t value, uint64_t offset, uint64_t nbytes) {
    return p->dtype[value] != 0 && (offset > p->nbytes[value] || nbytes > p->nbytes[value] - offset);
}

/* Decodes p->words into p; returns NULL or what is wrong. */
static const char *decode(fmha_program *p) {
    reader r = {p->words, p->word_count, 0, 0};
    if (read_word(&r) != PROGRAM_MAGIC) return "it does not start with the launch program magic";
    if (read_word(&r) != PROGRAM_FORMAT) return "its format version is not the one this shim reads";
    fmha_replay_plan *plan = &p->plan;
    p->value_count = (size_t)read_range(&r, 0, MAX_VALUES);
    p->operands = (size_t)read_range(&r, 0, (int64_t)p->value_count);
    plan->fill_count = (size_t)read_range(&r, 0, MAX_VALUES);
    plan->launch_count = (size_t)read_range(&r, 0, MAX_LAUNCHES);
    plan->overlap_count = (size_t)read_range(&r, 0, MAX_OVERLAPS);
    int64_t workspace = read_range(&r, -1, (int64_t)p->value_count - 1);
    plan->workspace_bytes = (uint64_t)read_range(&r, 0, INT64_MAX);
    if (r.bad) return "its header is out of range";
    plan->value_count = (uint32_t)p->value_count;
    plan->workspace_value = workspace < 0 ? 0 : (uint32_t)workspace;
    if (workspace < 0 && plan->workspace_bytes) return "it has workspace bytes but no workspace value";
    read_string(&r, p->label, sizeof p->label);
    int64_t last = (int64_t)p->value_count - 1;
    for (size_t i = 0; i < p->value_count; ++i) {
        p->dtype[i] = read_word(&r);
        p->nbytes[i] = (uint64_t)read_range(&r, 0, INT64_MAX);
    }
    for (size_t i = 0; i < plan->fill_count && !r.bad; ++i) {
        fmha_replay_fill *f = &p->fills[i];
        f->value = (uint32_t)read_range(&r, 0, last);
        f->offset = (uint64_t)read_range(&r, 0, INT64_MAX);
        f->nbytes = (uint64_t)read_range(&r, 0, INT64_MAX);
        if (!r.bad && outside(p, f->value, f->offset, f->nbytes)) return "a zeroed region lies outside its buffer";
    }
    size_t patches = 0;
    for (size_t i = 0; i < plan->launch_count && !r.bad; ++i) {
        fmha_launch_config *l = &p->launches[i];
        read_string(&r, p->keys[i], sizeof p->keys[i]);
        l->kernel = NULL;
        for (int d = 0; d < 3; ++d) l->grid[d] = (unsigned int)read_range(&r, 1, UINT32_MAX);
        for (int d = 0; d < 3; ++d) l->block[d] = (unsigned int)read_range(&r, 1, 1024);
        l->dynamic_shared_bytes = (unsigned int)read_range(&r, 0, UINT32_MAX);
        l->args = (void *)read_bytes(&r, MAX_TEMPLATE_BYTES, &l->args_size);
        size_t count = (size_t)read_range(&r, 0, MAX_PATCHES - (int64_t)patches);
        for (size_t j = 0; j < count && !r.bad; ++j, ++patches) {
            fmha_replay_patch *pt = &p->patches[patches];
            pt->launch = (uint32_t)i;
            pt->arg_offset = (uint32_t)read_range(&r, 0, (int64_t)l->args_size - 8);
            pt->value = (uint32_t)read_range(&r, 0, last);
            pt->addend = (uint64_t)read_range(&r, 0, INT64_MAX);
            pt->align = (uint32_t)read_range(&r, 1, MAX_POINTER_ALIGN);
            if (pt->align & (pt->align - 1)) r.bad = 1;
            if (!r.bad && outside(p, pt->value, pt->addend, 0)) return "a pointer lies outside its buffer";
        }
    }
    plan->patch_count = patches;
    for (size_t i = 0; i < plan->overlap_count && !r.bad; ++i) {
        fmha_replay_overlap *o = &p->overlaps[i];
        o->output = (uint32_t)read_range(&r, 0, last);
        o->other = (uint32_t)read_range(&r, 0, last);
        o->low = read_word(&r);
        o->high = read_word(&r);
    }
    if (r.bad) return "it is truncated or holds a value out of range";
    if (r.next != r.count) return "it has words past its end";
    return NULL;
}

int fmha_program_load(const int64_t *words, size_t count, fmha_program **out, char *why, size_t why_size) {
    if (words == NULL || out == NULL || why == NULL || why_size == 0) return FMHA_ERR_BAD_ARGUMENT;
    *out = NULL;
    why[0] = 0;
    fmha_program *p = malloc(sizeof *p + count * sizeof *words);
    if (p == NULL) {
        snprintf(why, why_size, "out of host memory");
        return FMHA_ERR_OUT_OF_MEMORY;
    }
    memset(p, 0, sizeof *p);
    memcpy(p->words, words, count * sizeof *words);
    p->word_count = count;
    const char *malformed = decode(p);
    if (malformed != NULL) {
        snprintf(why, why_size, "the launch program is malformed: %s", malformed);
        free(p);
        return FMHA_ERR_BAD_ARGUMENT;
    }
    p->plan.launches = p->launches;
    p->plan.patches = p->patches;
    p->plan.overlaps = p->overlaps;
    p->plan.fills = p->fills;
    *out = p;
    return FMHA_OK;
}

int fmha_program_bind(fmha_program *p, int device, fmha_kernel **kernels, uint64_t graph_id, char *why,
                      size_t why_size) {
    if (p == NULL || why == NULL || why_size == 0) return FMHA_ERR_BAD_ARGUMENT;
    why[0] = 0;
    for (size_t i = 0; i < p->plan.launch_count; ++i) {
        /* the caller's handles where it gives them (they are its ops' to interpret), else the registered images' */
        fmha_kernel *kernel = kernels != NULL ? kernels[i] : NULL;
        int status = kernels != NULL ? FMHA_OK : fmha_image_kernel(device, p->keys[i], &kernel);
        if (status != FMHA_OK) {
            snprintf(why, why_size, "kernel '%s' on device %d: %s", p->keys[i], device, fmha_last_error());
            return status;
        }
        p->launches[i].kernel = kernel;
    }
    p->plan.device = device;
    p->plan.graph_id = graph_id;
    return FMHA_OK;
}

const fmha_replay_plan *fmha_program_plan(const fmha_program *program) { return &program->plan; }

void fmha_program_free(fmha_program *program) { free(program); }
