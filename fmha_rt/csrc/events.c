/*
 * Ordering a call's stream after an array's producer (include/fmha_rt.h, block "ordering a call's
 * stream after an array's producer").
 *
 * An array whose producer says its data is still being written on another stream is read only after
 * that stream's work: an event recorded there, waited on by the call's stream, orders the two on the
 * device without stopping the host. Creating an event costs a driver call and memory, so events are
 * kept and reused: once the wait is queued the driver has taken what it needs of the event, and the
 * next record may reuse it at once. A slot belongs to one (ops, device) because the ops own the
 * events (a stand-in driver's events go back to it). When every slot is taken, an idle slot of other
 * ops is taken over and its event forgotten: ops other than the shim's own are stand-ins whose
 * events are tokens, and whose callbacks may already be gone.
 *
 * The mutex guards only the slots' bookkeeping; the driver calls run outside it, on a slot its
 * caller holds.
 */
#include "fmha_rt.h"

#include <pthread.h>

typedef struct slot {
    const fmha_replay_ops *ops; /* NULL: a free slot */
    int device;
    uint64_t event; /* 0 while its holder creates it */
    int held;
} slot;

static struct {
    pthread_mutex_t lock;
    slot slots[FMHA_EVENT_POOL];
} g_pool = {PTHREAD_MUTEX_INITIALIZER, {{0}}};

/* An idle slot of (ops, device), else a free slot, else an idle slot of other ops (its event
   forgotten), now held by the caller; NULL when there is none. */
static slot *hold(const fmha_replay_ops *ops, int device) {
    pthread_mutex_lock(&g_pool.lock);
    slot *idle = NULL, *free_slot = NULL, *foreign = NULL;
    for (size_t i = 0; i < FMHA_EVENT_POOL && idle == NULL; ++i) {
        slot *s = &g_pool.slots[i];
        if (s->held) continue;
        if (s->ops == ops && s->device == device) idle = s;
        else if (s->ops == NULL && free_slot == NULL) free_slot = s;
        else if (s->ops != ops && foreign == NULL) foreign = s;
    }
    slot *taken = idle != NULL ? idle : free_slot != NULL ? free_slot : foreign;
    if (taken != NULL && taken != idle) *taken = (slot){ops, device, 0, 0};
    if (taken != NULL) taken->held = 1;
    pthread_mutex_unlock(&g_pool.lock);
    return taken;
}

/* Let go of a held slot with its event; without one (its creation failed) the slot is free again. */
static void unhold(slot *s, uint64_t event) {
    pthread_mutex_lock(&g_pool.lock);
    s->held = 0;
    s->event = event;
    if (event == 0) s->ops = NULL;
    pthread_mutex_unlock(&g_pool.lock);
}

int fmha_stream_order(const fmha_replay_ops *ops, int device, uint64_t producer, uint64_t consumer) {
    if (ops == NULL) return FMHA_ERR_BAD_ARGUMENT;
    slot *s = hold(ops, device);
    if (s == NULL) return FMHA_ERR_OUT_OF_MEMORY;
    uint64_t event = s->event; /* only its holder writes a held slot */
    int status = event == 0 ? ops->event_create(device, &event) : FMHA_OK;
    if (status != FMHA_OK) event = 0; /* a failed create may have written anything */
    if (status == FMHA_OK) status = ops->event_record(device, event, producer);
    if (status == FMHA_OK) status = ops->stream_wait_event(device, consumer, event);
    unhold(s, event);
    return status;
}

int fmha_events_kept(const fmha_replay_ops *ops, size_t *count) {
    if (count == NULL) return FMHA_ERR_BAD_ARGUMENT;
    pthread_mutex_lock(&g_pool.lock);
    size_t n = 0;
    for (size_t i = 0; i < FMHA_EVENT_POOL; ++i) n += g_pool.slots[i].ops == ops && g_pool.slots[i].event != 0;
    pthread_mutex_unlock(&g_pool.lock);
    *count = n;
    return FMHA_OK;
}
