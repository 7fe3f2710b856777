/* A C program against the C ABI: one small forward on the CPU backend, a check of the output
 * against a hand-rolled recurrence, and one rejected call. Exit code 0 on success. */
#include <flashgdn/flashgdn.h>

#include <math.h>
#include <stdio.h>
#include <string.h>

enum { B = 1, T = 5, H = 1, D = 16 };

static fgdn_tensor contiguous(void* data, fgdn_dtype dtype, int ndim, const int64_t* shape) {
  fgdn_tensor t = fgdn_tensor_none();
  int64_t stride = 1;
  int i;
  t.data = data;
  t.dtype = dtype;
  t.ndim = ndim;
  t.device_type = FGDN_CPU;
  for (i = ndim - 1; i >= 0; --i) {
    t.shape[i] = shape[i];
    t.strides[i] = stride;
    stride *= shape[i];
  }
  return t;
}

int main(void) {
  static float q[B * T * H * D], k[B * T * H * D], v[B * T * H * D], g[B * T * H],
      beta[B * T * H], o[B * T * H * D], ht[H * D * D];
  const int64_t qs[4] = {B, T, H, D}, gs[3] = {B, T, H}, ss[4] = {1, H, D, D};
  fgdn_fwd_args a;
  double S[D][D], err = 0.0, ref = 0.0;
  int t, i, j;

  for (i = 0; i < B * T * H * D; ++i) {
    q[i] = (float)sin(0.37 * i);
    k[i] = (float)cos(0.11 * i) * 0.25f;
    v[i] = (float)sin(0.05 * i + 1.0);
  }
  for (i = 0; i < B * T * H; ++i) {
    g[i] = -0.1f * (float)(i + 1);
    beta[i] = 0.5f;
  }
  memset(&a, 0, sizeof(a));
  a.in.q = contiguous(q, FGDN_FLOAT32, 4, qs);
  a.in.k = contiguous(k, FGDN_FLOAT32, 4, qs);
  a.in.v = contiguous(v, FGDN_FLOAT32, 4, qs);
  a.in.g = contiguous(g, FGDN_FLOAT32, 3, gs);
  a.in.beta = contiguous(beta, FGDN_FLOAT32, 3, gs);
  a.o = contiguous(o, FGDN_FLOAT32, 4, qs);
  a.final_state = contiguous(ht, FGDN_FLOAT32, 4, ss);
  a.output_final_state = 1;
  if (fgdn_forward(&a, NULL, 0, NULL) != FGDN_SUCCESS) {
    fprintf(stderr, "forward failed: %s\n", fgdn_last_error());
    return 1;
  }

  /* The recurrence written out: S = e^g S; S += beta k (v - S^T k)^T; o = scale S^T q. */
  memset(S, 0, sizeof(S));
  for (t = 0; t < T; ++t) {
    const float* kt = k + t * D;
    const float* vt = v + t * D;
    const float* qt = q + t * D;
    double r[D];
    for (i = 0; i < D; ++i)
      for (j = 0; j < D; ++j) S[i][j] *= exp(g[t]);
    for (j = 0; j < D; ++j) {
      double sk = 0.0;
      for (i = 0; i < D; ++i) sk += S[i][j] * kt[i];
      r[j] = vt[j] - sk;
    }
    for (i = 0; i < D; ++i)
      for (j = 0; j < D; ++j) S[i][j] += beta[t] * kt[i] * r[j];
    for (j = 0; j < D; ++j) {
      double out = 0.0;
      for (i = 0; i < D; ++i) out += S[i][j] * qt[i];
      out /= sqrt((double)D);
      err += (out - o[t * D + j]) * (out - o[t * D + j]);
      ref += out * out;
    }
  }
  printf("c_api: relative L2 error of o = %.3g\n", sqrt(err / ref));
  if (!(sqrt(err / ref) < 1e-5)) return 1;

  /* A rejected call: v with a head count that is not a multiple of Hq... here a wrong rank. */
  a.in.v.ndim = 3;
  if (fgdn_forward(&a, NULL, 0, NULL) != FGDN_ERROR_INVALID_ARGUMENT ||
      strstr(fgdn_last_error(), "'v'") == NULL) {
    fprintf(stderr, "expected a rejection naming 'v', got: %s\n", fgdn_last_error());
    return 1;
  }
  printf("c_api: rejected as expected: %s\n", fgdn_last_error());
  return 0;
}
