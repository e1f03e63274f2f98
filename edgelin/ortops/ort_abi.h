/* The slice of ONNX Runtime's C ABI that edgelin's operator library calls, declared here so that the library
   builds with a C compiler alone (the onnxruntime wheel ships no headers).

   ONNX Runtime's C API is one table of function pointers (OrtApi) that only ever grows at its end: a slot, once
   released, keeps its position in every later version. The slots below are positions in that table as
   onnxruntime_c_api.h and the C# bindings (NativeMethods.shared.cs) list it; the API version that first has
   each slot is at most ORT_ABI_VERSION. tests/test_ortops.py checks them against the installed runtime. */
#ifndef EDGELIN_ORT_ABI_H
#define EDGELIN_ORT_ABI_H
#include <stddef.h>
#include <stdint.h>

#define ORT_ABI_VERSION 16        /* CreateKernelV2 / KernelComputeV2 (status returns) */
#define ORT_ABI_PARALLEL_FOR 20   /* a runtime this new has KernelContext_ParallelFor */

typedef struct OrtStatus OrtStatus;
typedef struct OrtApi OrtApi;
typedef struct OrtValue OrtValue;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;

typedef struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)(void);
} OrtApiBase;

enum { ORT_OK = 0, ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };
enum { ORT_TYPE_UNDEFINED = 0, ORT_TYPE_FLOAT = 1, ORT_TYPE_UINT8 = 2, ORT_TYPE_INT32 = 6, ORT_TYPE_FLOAT16 = 10 };       /* ONNXTensorElementDataType */
enum { ORT_IO_REQUIRED = 0, ORT_IO_OPTIONAL = 1 };                            /* input/output characteristic */

/* OrtCustomOp through version 16; ORT reads no field newer than the version the op states */
typedef struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const struct OrtCustomOp*, const OrtApi*, const OrtKernelInfo*);
  const char* (*GetName)(const struct OrtCustomOp*);
  const char* (*GetExecutionProviderType)(const struct OrtCustomOp*);
  int (*GetInputType)(const struct OrtCustomOp*, size_t);
  size_t (*GetInputTypeCount)(const struct OrtCustomOp*);
  int (*GetOutputType)(const struct OrtCustomOp*, size_t);
  size_t (*GetOutputTypeCount)(const struct OrtCustomOp*);
  void (*KernelCompute)(void*, OrtKernelContext*);
  void (*KernelDestroy)(void*);
  int (*GetInputCharacteristic)(const struct OrtCustomOp*, size_t);
  int (*GetOutputCharacteristic)(const struct OrtCustomOp*, size_t);
  int (*GetInputMemoryType)(const struct OrtCustomOp*, size_t);
  int (*GetVariadicInputMinArity)(const struct OrtCustomOp*);
  int (*GetVariadicInputHomogeneity)(const struct OrtCustomOp*);
  int (*GetVariadicOutputMinArity)(const struct OrtCustomOp*);
  int (*GetVariadicOutputHomogeneity)(const struct OrtCustomOp*);
  OrtStatus* (*CreateKernelV2)(const struct OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void**);
  OrtStatus* (*KernelComputeV2)(void*, OrtKernelContext*);
} OrtCustomOp;

/* OrtApi slots (positions in the table) */
#define ORT_SLOT_CreateStatus 0
#define ORT_SLOT_GetErrorCode 1
#define ORT_SLOT_GetErrorMessage 2
#define ORT_SLOT_CreateCustomOpDomain 26
#define ORT_SLOT_CustomOpDomain_Add 27
#define ORT_SLOT_AddCustomOpDomain 28
#define ORT_SLOT_GetTensorMutableData 51
#define ORT_SLOT_GetDimensionsCount 61
#define ORT_SLOT_GetDimensions 62
#define ORT_SLOT_GetTensorTypeAndShape 65
#define ORT_SLOT_KernelInfoGetAttribute_float 85
#define ORT_SLOT_KernelInfoGetAttribute_int64 86
#define ORT_SLOT_KernelInfoGetAttribute_string 87
#define ORT_SLOT_KernelContext_GetInputCount 88
#define ORT_SLOT_KernelContext_GetInput 90
#define ORT_SLOT_KernelContext_GetOutput 91
#define ORT_SLOT_ReleaseStatus 93
#define ORT_SLOT_ReleaseTensorTypeAndShapeInfo 99
#define ORT_SLOT_KernelInfoGetConstantInput_tensor 249
#define ORT_SLOT_KernelContext_ParallelFor 274

typedef OrtStatus* (*OrtCreateStatusFn)(int code, const char* msg);
typedef OrtStatus* (*OrtCreateCustomOpDomainFn)(const char* domain, OrtCustomOpDomain** out);
typedef OrtStatus* (*OrtCustomOpDomain_AddFn)(OrtCustomOpDomain* domain, const OrtCustomOp* op);
typedef OrtStatus* (*OrtAddCustomOpDomainFn)(OrtSessionOptions* options, OrtCustomOpDomain* domain);
typedef const char* (*OrtGetErrorMessageFn)(const OrtStatus* status);
typedef OrtStatus* (*OrtGetTensorMutableDataFn)(OrtValue* value, void** out);
typedef OrtStatus* (*OrtGetDimensionsCountFn)(const OrtTensorTypeAndShapeInfo* info, size_t* out);
typedef OrtStatus* (*OrtGetDimensionsFn)(const OrtTensorTypeAndShapeInfo* info, int64_t* values, size_t count);
typedef OrtStatus* (*OrtGetTensorTypeAndShapeFn)(const OrtValue* value, OrtTensorTypeAndShapeInfo** out);
typedef OrtStatus* (*OrtKernelInfoGetAttribute_floatFn)(const OrtKernelInfo* info, const char* name, float* out);
typedef OrtStatus* (*OrtKernelInfoGetAttribute_stringFn)(const OrtKernelInfo* info, const char* name, char* out,
                                                         size_t* size);
typedef OrtStatus* (*OrtKernelInfoGetAttribute_int64Fn)(const OrtKernelInfo* info, const char* name, int64_t* out);
typedef OrtStatus* (*OrtKernelContext_GetInputCountFn)(const OrtKernelContext* context, size_t* out);
typedef OrtStatus* (*OrtKernelContext_GetInputFn)(const OrtKernelContext* context, size_t index, const OrtValue** out);
typedef OrtStatus* (*OrtKernelContext_GetOutputFn)(OrtKernelContext* context, size_t index, const int64_t* dims,
                                                  size_t count, OrtValue** out);
typedef void (*OrtReleaseStatusFn)(OrtStatus* status);
typedef void (*OrtReleaseTensorTypeAndShapeInfoFn)(OrtTensorTypeAndShapeInfo* info);
typedef OrtStatus* (*OrtKernelInfoGetConstantInput_tensorFn)(const OrtKernelInfo* info, size_t index, int* is_constant,
                                                             const OrtValue** out);
typedef OrtStatus* (*OrtKernelContext_ParallelForFn)(const OrtKernelContext* context, void (*fn)(void*, size_t),
                                                    size_t total, size_t num_batch, void* user_data);

#define ORT_CALL(api, name) ((Ort##name##Fn)(((void* const*)(api))[ORT_SLOT_##name]))

#endif
