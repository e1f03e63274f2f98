/* edgelin's decode attention: what com.microsoft::GroupQueryAttention computes for a few new tokens over a KV cache
   (no rotary, no window, no softcap), each cached key and value read once for all the query heads that share it. */
#ifndef EDGELIN_ATTENTION_H
#define EDGELIN_ATTENTION_H
#include <stddef.h>
#include <stdint.h>

#include "cpu.h"

/* One call. The cache already holds this call's keys and values (ops_attention.c writes them first): token i of
   sequence b sits at position p = seqlens[b] - (S - 1) + i and attends rows 0 .. p. Query head h reads kv head
   h / (Hq / Hkv). The rows of each (sequence, token, kv head) are cut into `splits` pieces, one task each, whose
   partial softmax sums edgelin_attention_merge adds up (tasks may run on different threads). */
typedef struct {
  const float* q;          /* [B, S, Hq * D] */
  const float* keys;       /* [B, Hkv, capacity, D] */
  const float* values;     /* [B, Hkv, capacity, D] */
  const int32_t* seqlens;  /* [B] */
  int64_t B, S, Hq, Hkv, D, capacity, splits;
  float scale;
  float* partial;          /* [tasks, G, D + 2]: per query head its running max, sum and weighted values */
  float* scratch;          /* [tasks, edgelin_attention_scratch_floats(G, D)] */
  float* out;              /* [B, S, Hq * D] */
} EdgelinAttention;

EDGELIN_API int64_t edgelin_attention_tasks(const EdgelinAttention* a);
EDGELIN_API int64_t edgelin_attention_scratch_floats(int64_t G, int64_t D);
EDGELIN_API void edgelin_attention_task(const EdgelinAttention* a, int64_t task);
EDGELIN_API void edgelin_attention_merge(const EdgelinAttention* a);
#endif
