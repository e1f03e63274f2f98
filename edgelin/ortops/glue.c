/* See glue.h. */
#include "glue.h"

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
