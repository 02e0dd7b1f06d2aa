#include "onnx_prep_native.h"

#ifndef ONNX_PREP_VERSION
#error "ONNX_PREP_VERSION must be defined by the build"
#endif

const char *op_native_version(void) { return ONNX_PREP_VERSION; }
