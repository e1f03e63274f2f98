/* edgelin's decode attention: what com.microsoft::GroupQueryAttention computes for a few new tokens over a KV cache
   (no rotary, no window, no softcap), each cached key and value read once for all the query heads that share it;
   float32 or float16 tensors (the arithmetic float32 either way). */
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
  const void* q;           /* [B, S, Hq * D] */
  const void* keys;        /* [B, Hkv, capacity, D] */
  const void* values;      /* [B, Hkv, capacity, D] */
  const int32_t* seqlens;  /* [B] */
  int64_t B, S, Hq, Hkv, D, capacity, splits;
  float scale;
  int half;                /* 1: q, keys, values and out are float16 (IEEE binary16), else float32 */
  float* partial;          /* [tasks, G, D + 2]: per query head its running max, sum and weighted values */
  float* scratch;          /* [tasks, edgelin_attention_scratch_floats(G, D)] */
  void* out;               /* [B, S, Hq * D] */
} EdgelinAttention;

EDGELIN_API int64_t edgelin_attention_tasks(const EdgelinAttention* a);
EDGELIN_API int64_t edgelin_attention_scratch_floats(int64_t G, int64_t D);
EDGELIN_API void edgelin_attention_task(const EdgelinAttention* a, int64_t task);
EDGELIN_API int edgelin_attention_merge(const EdgelinAttention* a);  /* 0, or -1: out of memory */
float edgelin_half_to_float(uint16_t h);
/* The pieces' shared steps (attention.c; the NEON path in arm/fused.c): rows per chunk of keys, and one chunk's
   softmax rescale of a head's running max m and sum l (returns the scale applied to the old weighted values). */
int64_t edgelin_attention_chunk_rows(int64_t D);
float edgelin_attention_rescale(float* m, float* l, float chunk_max);
uint16_t edgelin_float_to_half(float value);
#endif
