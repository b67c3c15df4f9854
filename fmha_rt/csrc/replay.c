/*
 * Replaying a cached call: the one C call behind a plan-cache hit (fmha_rt/replay/plan_cache.py).
 *
 * The plan was recorded from a planned call: each launch's argument bytes as packed then, and where
 * in them the values that change per call go. A hit hands over its values; this checks what depends
 * on them, writes them into a copy of each template on the stack (the driver copies the arguments
 * when a launch is queued, so nothing outlives the call and concurrent calls share nothing), zeroes
 * the workspace regions that must start at zero and launches, as one graph where launch_graphs.c keeps
 * one. The checks come first, so a refused call has written nothing. The values are copied before
 * anything else: a launch may call back into Python (a stand-in driver does), and a cached call made
 * there on the same thread reuses that thread's value array.
 */
#include "fmha_rt.h"

#include <string.h>

static int overlaps(const fmha_replay_plan *p, const uint64_t *values, size_t *failed) {
    for (size_t i = 0; i < p->overlap_count; ++i) {
        const fmha_replay_overlap *o = &p->overlaps[i];
        int64_t distance = (int64_t)(values[o->other] - values[o->output]);
        if (o->low < distance && distance < o->high) {
            *failed = i;
            return 1;
        }
    }
    return 0;
}

static int misaligned(const fmha_replay_plan *p, const uint64_t *values, size_t *failed) {
    for (size_t i = 0; i < p->patch_count; ++i) {
        const fmha_replay_patch *pt = &p->patches[i];
        if ((values[pt->value] + pt->addend) % pt->align) {
            *failed = i;
            return 1;
        }
    }
    return 0;
}

/* Launch `first`..`first + count` of the plan with the call's values written into copies of their
   templates in `args`: as the plan's kept graph where launch_graphs.c takes them, else one by one.
   *pt is the next patch to write (patches come sorted by launch). */
static int launch_batch(const fmha_replay_plan *p, const fmha_replay_ops *ops, const uint64_t *values,
                        uint64_t stream, int capturing, size_t first, size_t count, const fmha_replay_patch **pt,
                        char (*args)[FMHA_REPLAY_MAX_ARGS], size_t *failed) {
    fmha_launch_config configs[FMHA_LAUNCH_GRAPH_MAX_NODES];
    const fmha_replay_patch *end = p->patches + p->patch_count;
    for (size_t j = 0; j < count; ++j) {
        configs[j] = p->launches[first + j];
        if (configs[j].args_size > FMHA_REPLAY_MAX_ARGS) {
            *failed = p->fill_count + first + j;
            return FMHA_ERR_BAD_ARGUMENT;
        }
        memcpy(args[j], configs[j].args, configs[j].args_size);
        for (; *pt < end && (*pt)->launch == first + j; ++*pt) {
            uint64_t value = values[(*pt)->value] + (*pt)->addend;
            memcpy(args[j] + (*pt)->arg_offset, &value, sizeof value);
        }
        configs[j].args = args[j];
    }
    int taken = 0;
    size_t node = 0;
    int status = count == p->launch_count ? fmha_launch_graph_run(ops, p, configs, stream, capturing, &taken, &node)
                                          : FMHA_OK;
    if (taken) {
        if (status != FMHA_OK) *failed = p->fill_count + node;
        return status;
    }
    for (size_t j = 0; j < count; ++j) {
        status = ops->launch(&configs[j], stream);
        if (status != FMHA_OK) {
            *failed = p->fill_count + first + j;
            return status;
        }
    }
    return FMHA_OK;
}

static int fill_and_launch(const fmha_replay_plan *p, const fmha_replay_ops *ops, const uint64_t *values,
                           uint64_t stream, int capturing, size_t *failed) {
    for (size_t i = 0; i < p->fill_count; ++i) {
        const fmha_replay_fill *f = &p->fills[i];
        if (f->nbytes == 0) continue; /* an empty region may point anywhere */
        int status = ops->memset_d8(p->device, values[f->value] + f->offset, 0, f->nbytes, stream);
        if (status != FMHA_OK) {
            *failed = i;
            return status;
        }
    }
    _Alignas(16) char args[FMHA_LAUNCH_GRAPH_MAX_NODES][FMHA_REPLAY_MAX_ARGS];
    const fmha_replay_patch *pt = p->patches;
    for (size_t first = 0; first < p->launch_count; first += FMHA_LAUNCH_GRAPH_MAX_NODES) {
        size_t left = p->launch_count - first;
        size_t count = left < FMHA_LAUNCH_GRAPH_MAX_NODES ? left : FMHA_LAUNCH_GRAPH_MAX_NODES;
        int status = launch_batch(p, ops, values, stream, capturing, first, count, &pt, args, failed);
        if (status != FMHA_OK) return status;
    }
    return FMHA_OK;
}

int fmha_replay(const fmha_replay_plan *p, const fmha_replay_ops *ops, uint64_t *call_values, uint64_t stream,
                int allocate_workspace, size_t *failed) {
    if (p == NULL || ops == NULL || call_values == NULL || failed == NULL || p->value_count > FMHA_REPLAY_MAX_VALUES ||
        (allocate_workspace && p->workspace_value >= p->value_count))
        return FMHA_ERR_BAD_ARGUMENT;
    uint64_t values[FMHA_REPLAY_MAX_VALUES];
    memcpy(values, call_values, p->value_count * sizeof *values);
    if (overlaps(p, values, failed)) return FMHA_ERR_OVERLAP;
    /* asked once, and only where an answer is needed: for our workspace and for a graph */
    int capturing = (allocate_workspace || p->graph_id != 0) && fmha_stream_capturing(ops, p->device, stream);
    fmha_workspace_lease workspace = {0, NULL};
    if (allocate_workspace) {
        int status = fmha_workspace_take(ops, p->device, stream, p->workspace_bytes, capturing, &workspace);
        if (status != FMHA_OK) {
            *failed = FMHA_REPLAY_FAILED_ALLOC;
            return status;
        }
        values[p->workspace_value] = call_values[p->workspace_value] = workspace.ptr;
    }
    int status = misaligned(p, values, failed) ? FMHA_ERR_MISALIGNED
                                               : fill_and_launch(p, ops, values, stream, capturing, failed);
    if (allocate_workspace) fmha_workspace_give(ops, p->device, stream, &workspace); /* the launches are queued */
    return status;
}

int fmha_stream_capturing(const fmha_replay_ops *ops, int device, uint64_t stream) {
    if (stream == 0) return 0;
    int status = 0;
    return ops->stream_capture_status(device, stream, &status) != FMHA_OK || status != 0;
}

const fmha_replay_ops *fmha_replay_native_ops(void) {
    static const fmha_replay_ops native = {
        .launch = fmha_launch_prepared, .memset_d8 = fmha_memset_d8, .mem_alloc = fmha_mem_alloc,
        .mem_free = fmha_mem_free, .stream_capture_status = fmha_stream_capture_status,
        .pointer_location = fmha_pointer_location, .event_create = fmha_event_create,
        .event_record = fmha_event_record, .stream_wait_event = fmha_stream_wait_event,
        .graph_create = fmha_graph_create, .graph_launch = fmha_graph_launch, .graph_destroy = fmha_graph_destroy};
    return &native;
}
