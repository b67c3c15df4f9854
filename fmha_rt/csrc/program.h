/*
 * A launch program decoded (program.c): what the plan cache keeps per signature and what the XLA
 * handler decodes per call. The wire format is fmha_rt/replay/program.py's, which documents it; its
 * constants are here and `python -m fmha_rt check` compares them with the Python ones.
 */
#ifndef FMHA_RT_PROGRAM_H
#define FMHA_RT_PROGRAM_H

#include "fmha_rt.h"

#define PROGRAM_MAGIC 0x3147525041484D46LL /* the bytes "FMHAPRG1" read as a little-endian int64 */
#define PROGRAM_FORMAT 3
#define MAX_VALUES 32
_Static_assert(MAX_VALUES == FMHA_REPLAY_MAX_VALUES, "a program's values are the replay's");
#define MAX_LAUNCHES 16
#define MAX_PATCHES 256
#define MAX_OVERLAPS 128
#define MAX_TEMPLATE_BYTES FMHA_REPLAY_MAX_ARGS /* the manifest's limit on a kernel's parameter bytes */
#define KEY_CHARS 160                          /* the shim's kernel key limit */
#define LABEL_CHARS 256
#define MAX_POINTER_ALIGN 4096

struct fmha_program {
    char label[LABEL_CHARS];
    size_t value_count, operands;   /* an XLA call's buffers are its values: operands first, then results */
    int64_t dtype[MAX_VALUES];      /* XLA's dtype number of a buffer; 0: a value that is no XLA buffer */
    uint64_t nbytes[MAX_VALUES];    /* a buffer's size (0 where unknown) */
    char keys[MAX_LAUNCHES][KEY_CHARS];
    fmha_launch_config launches[MAX_LAUNCHES]; /* their args point into `words` */
    fmha_replay_patch patches[MAX_PATCHES];
    fmha_replay_overlap overlaps[MAX_OVERLAPS];
    fmha_replay_fill fills[MAX_VALUES];
    fmha_replay_plan plan;
    size_t word_count;
    int64_t words[]; /* the program's own copy of the wire words */
};

#endif
