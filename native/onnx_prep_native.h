/* onnx_prep native API. This header IS the cffi cdef: build_native.py reads the
 * part between the CDEF markers, so Python and C cannot drift.
 * Exported names carry the op_ prefix. */
#ifndef ONNX_PREP_NATIVE_H
#define ONNX_PREP_NATIVE_H
#include <stddef.h>
#include <stdint.h>

/* CDEF-BEGIN */
const char *op_native_version(void);
/* CDEF-END */

#endif
