/* The ONNX Runtime C API as the operator library spells it, from one of two sources:
   - ONNX Runtime's own onnxruntime_c_api.h, when the build has it (CMake defines EDGELIN_ORT_HEADER: found in
     -DONNXRUNTIME_INCLUDE_DIR or an installed ONNX Runtime; edgelin/ortops/CMakeLists.txt);
   - else ort_abi.h, which declares the same slots by position (no package registry ships the official header:
     the onnxruntime wheels carry none; docs/development.md), so a C compiler alone builds the library.
   The kernels call ORT_CALL(api, Name) and use the names below either way. */
#ifndef EDGELIN_ORT_API_H
#define EDGELIN_ORT_API_H

#ifdef EDGELIN_ORT_HEADER
#include <onnxruntime_c_api.h>
#if ORT_API_VERSION < 20
#error "edgelin's CPU kernels need onnxruntime_c_api.h from ONNX Runtime 1.20 or newer (KernelContext_ParallelFor)"
#endif

#define ORT_ABI_VERSION 16        /* CreateKernelV2 / KernelComputeV2 (status returns) */
#define ORT_ABI_PARALLEL_FOR 20   /* a runtime this new has KernelContext_ParallelFor */
typedef ONNXTensorElementDataType EdgelinElementType;
typedef OrtCustomOpInputOutputCharacteristic EdgelinIoKind;
typedef OrtMemType EdgelinMemoryKind;
#define ORT_TYPE_FLOAT ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT
#define ORT_TYPE_UINT8 ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8
#define ORT_TYPE_INT32 ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32
#define ORT_TYPE_FLOAT16 ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16
#define ORT_IO_REQUIRED INPUT_OUTPUT_REQUIRED
#define ORT_IO_OPTIONAL INPUT_OUTPUT_OPTIONAL
#define ORT_MEM_DEFAULT OrtMemTypeDefault
#define ORT_CALL(api, name) ((api)->name)   /* ORT_OK / ORT_INVALID_ARGUMENT: OrtErrorCode's own names */

#else
#include "ort_abi.h"

typedef int EdgelinElementType;
typedef int EdgelinIoKind;
typedef int EdgelinMemoryKind;
#define ORT_MEM_DEFAULT 0
#endif

#endif
