/*
 * Launch graphs of cached calls (include/fmha_rt.h, block "launch graphs of cached calls").
 *
 * A slot keeps one graph for (ops, plan graph_id, device, stream). A call holds its slot from taking
 * it to the graph's launch; a second call for the same slot meanwhile (another thread, or a call made
 * from inside a stand-in driver's launch) launches one by one rather than wait. Graph ids are never
 * reused, so a dead plan's graph is never launched for another plan: it waits in its slot until it is
 * the least recently used one and a new graph needs the slot. The table's mutex guards only the
 * bookkeeping; the driver calls run outside it, on a slot their caller holds or has taken out.
 */
#include "fmha_rt.h"

#include <pthread.h>

typedef struct slot {
    const fmha_replay_ops *ops; /* NULL: a free slot */
    uint64_t id;
    int device;
    uint64_t stream;
    void *graph;  /* NULL before it is made, and when making it failed */
    int failed;   /* making the graph failed: launch one by one */
    int held;     /* a call has it */
    int dropped;  /* released while held: freed when the call is done */
    uint64_t used; /* the table's clock at its last take */
} slot;

static struct {
    pthread_mutex_t lock;
    uint64_t clock;
    slot slots[FMHA_LAUNCH_GRAPH_SLOTS];
} g_graphs = {PTHREAD_MUTEX_INITIALIZER, 0, {{0}}};

static const slot EMPTY = {0};

/* The slot of (ops, plan, stream), claimed (a free slot, else the least recently used idle one, whose
   graph goes to *evicted) if it has none, now held by the caller; NULL when another call holds it or
   every slot is held. */
static slot *hold(const fmha_replay_ops *ops, const fmha_replay_plan *plan, uint64_t stream, slot *evicted) {
    pthread_mutex_lock(&g_graphs.lock);
    slot *found = NULL, *victim = NULL;
    for (size_t i = 0; i < FMHA_LAUNCH_GRAPH_SLOTS && found == NULL; ++i) {
        slot *s = &g_graphs.slots[i];
        if (s->ops == ops && s->id == plan->graph_id && s->device == plan->device && s->stream == stream) found = s;
        else if (!s->held && (victim == NULL || (victim->ops != NULL && (s->ops == NULL || s->used < victim->used))))
            victim = s; /* a free slot, else the least recently used idle one */
    }
    if (found == NULL && victim != NULL) {
        *evicted = *victim;
        *victim = (slot){ops, plan->graph_id, plan->device, stream, NULL, 0, 0, 0, 0};
        found = victim;
    }
    if (found != NULL && found->held) found = NULL;
    if (found != NULL) {
        found->held = 1;
        found->used = ++g_graphs.clock;
    }
    pthread_mutex_unlock(&g_graphs.lock);
    return found;
}

/* Let go of a held slot; *graph, the graph to free now (the slot was released meanwhile, or its graph
   failed and must not be launched again), else NULL. */
static void unhold(slot *s, int drop_graph, void **graph) {
    pthread_mutex_lock(&g_graphs.lock);
    *graph = NULL;
    s->held = 0;
    if (s->dropped || drop_graph) {
        *graph = s->graph;
        *s = EMPTY;
    }
    pthread_mutex_unlock(&g_graphs.lock);
}

int fmha_launch_graph_run(const fmha_replay_ops *ops, const fmha_replay_plan *plan, const fmha_launch_config *launches,
                          uint64_t stream, int capturing, int *taken, size_t *failed) {
    *taken = 0;
    if (plan->graph_id == 0 || plan->launch_count == 0 || plan->launch_count > FMHA_LAUNCH_GRAPH_MAX_NODES ||
        ops->graph_create == NULL || ops->graph_launch == NULL || ops->graph_destroy == NULL || capturing)
        return FMHA_OK;
    slot evicted = EMPTY;
    slot *s = hold(ops, plan, stream, &evicted);
    if (evicted.graph != NULL) evicted.ops->graph_destroy(evicted.graph);
    if (s == NULL) return FMHA_OK;
    /* Only the holder writes its slot's graph and flag; the lock is for the readers of the whole table. */
    if (s->graph == NULL && !s->failed) {
        void *graph = NULL;
        int made = ops->graph_create(plan->device, launches, plan->launch_count, &graph) == FMHA_OK;
        pthread_mutex_lock(&g_graphs.lock);
        s->graph = made ? graph : NULL;
        s->failed = !made;
        pthread_mutex_unlock(&g_graphs.lock);
    }
    int status = FMHA_OK;
    if (s->graph != NULL) {
        *taken = 1;
        status = ops->graph_launch(s->graph, launches, plan->launch_count, stream, failed);
    }
    void *drop = NULL;
    unhold(s, status != FMHA_OK, &drop); /* a failed graph is made anew by the next call */
    if (drop != NULL) ops->graph_destroy(drop);
    return status;
}

int fmha_launch_graphs_release(void) {
    slot idle[FMHA_LAUNCH_GRAPH_SLOTS];
    size_t count = 0;
    pthread_mutex_lock(&g_graphs.lock);
    for (size_t i = 0; i < FMHA_LAUNCH_GRAPH_SLOTS; ++i) {
        slot *s = &g_graphs.slots[i];
        if (s->ops == NULL) continue;
        if (s->held) {
            s->dropped = 1;
            continue;
        }
        idle[count++] = *s;
        *s = EMPTY;
    }
    pthread_mutex_unlock(&g_graphs.lock);
    int first = FMHA_OK;
    for (size_t i = 0; i < count; ++i) {
        if (idle[i].graph == NULL) continue;
        int status = idle[i].ops->graph_destroy(idle[i].graph);
        if (first == FMHA_OK) first = status;
    }
    return first;
}

int fmha_launch_graphs_kept(size_t *count) {
    if (count == NULL) return FMHA_ERR_BAD_ARGUMENT;
    *count = 0;
    pthread_mutex_lock(&g_graphs.lock);
    for (size_t i = 0; i < FMHA_LAUNCH_GRAPH_SLOTS; ++i) *count += g_graphs.slots[i].ops != NULL;
    pthread_mutex_unlock(&g_graphs.lock);
    return FMHA_OK;
}
