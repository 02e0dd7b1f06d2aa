/* Element-wise math the numpy kernels lack, for ops without a numpy ufunc.
 *
 * erf: numpy has no erf, and a Python-level loop over math.erf costs ~0.3-0.5 us an
 * element (Erf, and Gelu without the tanh approximation, in BERT / GPT-2 style
 * exports). This is the same function, libm's erf() in double precision, called from
 * C: the results are bit-identical to math.erf (CPython calls libm's erf too), so the
 * op's output does not change, only its speed. The scalar loop is its own reference. */
#include <math.h>

#include "op_internal.h"

void op_erf_f64(const double *x, double *y, size_t n) {
    op_ran(OP_KERNEL_SCALAR);
    for (size_t i = 0; i < n; i++) y[i] = erf(x[i]);
}
