/*
 * Replaying a cached call: the one C call behind a plan-cache hit (fmha_rt/plan_cache.py).
 *
 * The plan was recorded from a planned call: each launch's argument bytes as packed then, and where
 * in them the values that change per call go. A hit hands over its values; this checks what depends
 * on them, writes them into a copy of each template on the stack (the driver copies the arguments
 * when a launch is queued, so nothing outlives the call and concurrent calls share nothing), zeroes
 * the workspace regions that must start at zero and launches. The checks come first, so a refused
 * call has written nothing. The values are copied before anything else: a launch may call back into
 * Python (a stand-in driver does), and a cached call made there on the same thread reuses that
 * thread's value array.
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

static int fill_and_launch(const fmha_replay_plan *p, const fmha_replay_ops *ops, const uint64_t *values,
                           uint64_t stream, size_t *failed) {
    for (size_t i = 0; i < p->fill_count; ++i) {
        const fmha_replay_fill *f = &p->fills[i];
        if (f->nbytes == 0) continue; /* an empty region may point anywhere */
        int status = ops->memset_d8(p->device, values[f->value] + f->offset, 0, f->nbytes, stream);
        if (status != FMHA_OK) {
            *failed = i;
            return status;
        }
    }
    _Alignas(16) char args[FMHA_REPLAY_MAX_ARGS];
    const fmha_replay_patch *pt = p->patches, *end = p->patches + p->patch_count;
    for (size_t i = 0; i < p->launch_count; ++i) {
        fmha_launch_config config = p->launches[i];
        if (config.args_size > sizeof args) {
            *failed = p->fill_count + i;
            return FMHA_ERR_BAD_ARGUMENT;
        }
        memcpy(args, config.args, config.args_size);
        for (; pt < end && pt->launch == i; ++pt) {
            uint64_t value = values[pt->value] + pt->addend;
            memcpy(args + pt->arg_offset, &value, sizeof value);
        }
        config.args = args;
        int status = ops->launch(&config, stream);
        if (status != FMHA_OK) {
            *failed = p->fill_count + i;
            return status;
        }
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
    fmha_workspace_lease workspace = {0, NULL};
    if (allocate_workspace) {
        int status = fmha_workspace_take(ops, p->device, stream, p->workspace_bytes, &workspace);
        if (status != FMHA_OK) {
            *failed = FMHA_REPLAY_FAILED_ALLOC;
            return status;
        }
        values[p->workspace_value] = call_values[p->workspace_value] = workspace.ptr;
    }
    int status = misaligned(p, values, failed) ? FMHA_ERR_MISALIGNED : fill_and_launch(p, ops, values, stream, failed);
    if (allocate_workspace) fmha_workspace_give(ops, p->device, stream, &workspace); /* the launches are queued */
    return status;
}

const fmha_replay_ops *fmha_replay_native_ops(void) {
    static const fmha_replay_ops native = {
        .launch = fmha_launch_prepared, .memset_d8 = fmha_memset_d8, .mem_alloc = fmha_mem_alloc,
        .mem_free = fmha_mem_free, .stream_capture_status = fmha_stream_capture_status,
        .pointer_location = fmha_pointer_location, .event_create = fmha_event_create,
        .event_record = fmha_event_record, .stream_wait_event = fmha_stream_wait_event};
    return &native;
}
