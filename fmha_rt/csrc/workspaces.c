/*
 * fmha_rt's own workspace, kept per stream (include/fmha_rt.h, block "fmha_rt's own workspace").
 *
 * A backward without a caller's workspace used to allocate its workspace stream-ordered and free it
 * after its launches, two driver calls per call. Here each (ops, device, stream) keeps one buffer of
 * the largest size taken so far and the next call on that stream takes it again: the stream orders
 * that call's zero fills and launches after everything the previous call queued, so the two never
 * use the buffer at the same time. The ops are part of the key because they own the memory (a
 * stand-in driver's buffers must go back to it).
 *
 * A buffer is held from fmha_workspace_take until fmha_workspace_give (the launches are queued by
 * then); a second call on the same stream in that window, from another thread, gets a buffer of its
 * own, since the two calls' fills and launches could interleave on the stream. The table's mutex
 * guards only the slots' bookkeeping; driver calls run outside it, on a slot its caller holds.
 */
#include "fmha_rt.h"

#include <pthread.h>

typedef struct slot {
    const fmha_replay_ops *ops; /* NULL: a free slot */
    int device;
    uint64_t stream;
    uint64_t ptr, bytes;
    int held;    /* a call has it, between take and give */
    int dropped; /* released while held: freed when given back */
} slot;

static struct {
    pthread_mutex_t lock;
    slot slots[FMHA_WORKSPACE_CACHE_STREAMS];
} g_cache = {PTHREAD_MUTEX_INITIALIZER, {{0}}};

/* The stream's slot, claimed if it has none yet, now held by the caller; NULL when another call holds
   it or every slot belongs to another stream. */
static slot *hold(const fmha_replay_ops *ops, int device, uint64_t stream) {
    pthread_mutex_lock(&g_cache.lock);
    slot *found = NULL, *free_slot = NULL;
    for (size_t i = 0; i < FMHA_WORKSPACE_CACHE_STREAMS && found == NULL; ++i) {
        slot *s = &g_cache.slots[i];
        if (s->ops == ops && s->device == device && s->stream == stream) found = s;
        else if (s->ops == NULL && free_slot == NULL) free_slot = s;
    }
    if (found == NULL && free_slot != NULL) {
        *free_slot = (slot){ops, device, stream, 0, 0, 0, 0};
        found = free_slot;
    }
    if (found != NULL && found->held) found = NULL;
    if (found != NULL) found->held = 1;
    pthread_mutex_unlock(&g_cache.lock);
    return found;
}

/* Replace a held slot's buffer by one of `bytes`. The old one is freed on the stream, so it goes only
   after the calls queued there; a failed free cannot be retried and leaves nothing to undo. Only the
   holder writes a slot's buffer; the lock is for the readers of the whole table. */
static int grow(slot *s, uint64_t bytes) {
    if (s->ptr != 0) s->ops->mem_free(s->device, s->ptr, s->stream);
    uint64_t ptr = 0;
    int status = s->ops->mem_alloc(s->device, bytes, s->stream, &ptr);
    pthread_mutex_lock(&g_cache.lock);
    s->ptr = status == FMHA_OK ? ptr : 0;
    s->bytes = status == FMHA_OK ? bytes : 0;
    pthread_mutex_unlock(&g_cache.lock);
    return status;
}

/* Let go of a held slot; returns the buffer to free when the slot was released meanwhile, else 0. */
static uint64_t unhold(slot *s) {
    pthread_mutex_lock(&g_cache.lock);
    uint64_t drop = 0;
    s->held = 0;
    if (s->dropped) {
        drop = s->ptr;
        *s = (slot){NULL, 0, 0, 0, 0, 0, 0};
    }
    pthread_mutex_unlock(&g_cache.lock);
    return drop;
}

int fmha_workspace_take(const fmha_replay_ops *ops, int device, uint64_t stream, uint64_t bytes, int capturing,
                        fmha_workspace_lease *lease) {
    if (ops == NULL || lease == NULL) return FMHA_ERR_BAD_ARGUMENT;
    slot *s = bytes <= FMHA_WORKSPACE_CACHE_MAX_BYTES && !capturing ? hold(ops, device, stream) : NULL;
    lease->slot = s;
    lease->ptr = 0;
    if (s == NULL) return ops->mem_alloc(device, bytes, stream, &lease->ptr);
    int status = s->bytes < bytes ? grow(s, bytes) : FMHA_OK;
    if (status != FMHA_OK) {
        unhold(s); /* grow left the slot without a buffer: nothing to free */
        lease->slot = NULL;
        return status;
    }
    lease->ptr = s->ptr;
    return FMHA_OK;
}

void fmha_workspace_give(const fmha_replay_ops *ops, int device, uint64_t stream, const fmha_workspace_lease *lease) {
    if (ops == NULL || lease == NULL) return;
    uint64_t drop = lease->slot != NULL ? unhold(lease->slot) : lease->ptr;
    if (drop != 0) ops->mem_free(device, drop, stream); /* stream-ordered: after the launches that use it */
}

int fmha_workspaces_release(void) {
    slot idle[FMHA_WORKSPACE_CACHE_STREAMS];
    size_t count = 0;
    pthread_mutex_lock(&g_cache.lock);
    for (size_t i = 0; i < FMHA_WORKSPACE_CACHE_STREAMS; ++i) {
        slot *s = &g_cache.slots[i];
        if (s->ops == NULL) continue;
        if (s->held) {
            s->dropped = 1;
            continue;
        }
        idle[count++] = *s;
        *s = (slot){NULL, 0, 0, 0, 0, 0, 0};
    }
    pthread_mutex_unlock(&g_cache.lock);
    int first = FMHA_OK;
    for (size_t i = 0; i < count; ++i) {
        if (idle[i].ptr == 0) continue;
        int status = idle[i].ops->mem_free(idle[i].device, idle[i].ptr, idle[i].stream);
        if (first == FMHA_OK) first = status;
    }
    return first;
}

int fmha_workspaces_kept(size_t *count, uint64_t *bytes) {
    if (count == NULL || bytes == NULL) return FMHA_ERR_BAD_ARGUMENT;
    *count = 0;
    *bytes = 0;
    pthread_mutex_lock(&g_cache.lock);
    for (size_t i = 0; i < FMHA_WORKSPACE_CACHE_STREAMS; ++i) {
        if (g_cache.slots[i].ptr == 0) continue;
        *count += 1;
        *bytes += g_cache.slots[i].bytes;
    }
    pthread_mutex_unlock(&g_cache.lock);
    return FMHA_OK;
}
