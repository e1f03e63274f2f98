/* See glue.h. */
#include "glue.h"

#include <stdlib.h>

const OrtApi* g_api;
int g_parallel_for;

OrtStatus* fail(const char* message) { return ORT_CALL(g_api, CreateStatus)(ORT_INVALID_ARGUMENT, message); }

OrtStatus* attribute(const OrtKernelInfo* info, const char* name, int64_t* out) {
  return ORT_CALL(g_api, KernelInfoGetAttribute_int64)(info, name, out);
}

int64_t attribute_or(const OrtKernelInfo* info, const char* name, int64_t fallback) {
  int64_t value = fallback;
  OrtStatus* missing = attribute(info, name, &value);
  if (missing) {
    ORT_CALL(g_api, ReleaseStatus)(missing);
    return fallback;
  }
  return value;
}

float float_attribute_or(const OrtKernelInfo* info, const char* name, float fallback) {
  float value = fallback;
  OrtStatus* missing = ORT_CALL(g_api, KernelInfoGetAttribute_float)(info, name, &value);
  if (missing) {
    ORT_CALL(g_api, ReleaseStatus)(missing);
    return fallback;
  }
  return value;
}

OrtStatus* shape_of(const OrtValue* value, int64_t* dims, size_t* rank) {
  OrtTensorTypeAndShapeInfo* info = NULL;
  OrtStatus* status = ORT_CALL(g_api, GetTensorTypeAndShape)(value, &info);
  if (!status) status = ORT_CALL(g_api, GetDimensionsCount)(info, rank);
  if (!status && *rank > 8) status = fail("edgelin ops: an input has more than 8 dimensions");
  if (!status) status = ORT_CALL(g_api, GetDimensions)(info, dims, *rank);
  if (info) ORT_CALL(g_api, ReleaseTensorTypeAndShapeInfo)(info);
  return status;
}

void* data_of(const OrtValue* value) {
  void* data = NULL;
  OrtStatus* status = ORT_CALL(g_api, GetTensorMutableData)((OrtValue*)value, &data);
  if (status) {
    ORT_CALL(g_api, ReleaseStatus)(status);
    return NULL;
  }
  return data;
}

OrtStatus* inputs_of(OrtKernelContext* context, size_t n, const OrtValue** in, int64_t (*dims)[8], size_t* ranks) {
  OrtStatus* status = NULL;
  for (size_t i = 0; !status && i < n; ++i) {
    status = ORT_CALL(g_api, KernelContext_GetInput)(context, i, &in[i]);
    if (!status) status = shape_of(in[i], dims[i], &ranks[i]);
  }
  return status;
}

int64_t count_of(const int64_t* dims, size_t rank) {
  int64_t n = 1;
  for (size_t i = 0; i < rank; ++i) n *= dims[i];
  return n;
}

OrtStatus* fused_heads_create(const OrtKernelInfo* info, const char* failure, int with_epsilon, void** out) {
  FusedHeads* s = calloc(1, sizeof(FusedHeads));
  if (!s) return fail("edgelin: out of memory");
  OrtStatus* status = attribute(info, "q_num_heads", &s->q_heads);
  if (!status) status = attribute(info, "kv_num_heads", &s->heads);
  if (!status) status = ORT_CALL(g_api, KernelInfoGetAttribute_float)(info, "scale", &s->scale);
  if (!status && with_epsilon) status = ORT_CALL(g_api, KernelInfoGetAttribute_float)(info, "epsilon", &s->epsilon);
  if (!status && (s->q_heads <= 0 || s->heads <= 0 || s->heads % s->q_heads || s->scale == 0.0f
                  || s->epsilon < 0.0f))
    status = fail(failure);
  if (status) {
    free(s);
    return status;
  }
  *out = s;
  return NULL;
}

void edgelin_destroy_fused(void* kernel) { free(kernel); }
