/*
 * flashgdn: gated delta rule (GDN) chunked prefill, forward and backward.
 *
 * C ABI. A C program can include this header and link libflashgdn. The C++ API in
 * flashgdn.hpp is a thin layer over these same structs and entry points.
 *
 * Conventions (the ecosystem's, as in FLA / FlashQLA / vLLM):
 *   q, k : [B, T, Hq, K]      v : [B, T, Hv, V]      g, beta : [B, T, Hv]
 *   states: [N, Hv, K, V] (or [N, Hv, V, K] with state_v_first), each state tensor in its own
 *   dtype: float32, bfloat16 or float16 (checkpoints: float32). The recurrence runs in float32:
 *   a state is converted to float32 on load (exactly) and rounded to nearest even on store.
 *   Hv is a multiple of Hq; value head h reads q/k head h / (Hv / Hq).
 *   Varlen: B == 1 and cu_seqlens [N + 1] (int32 or int64) packs N sequences along T.
 *
 * The recurrence, per sequence and value head (S is K x V):
 *   S~_t = exp(g_t) S_{t-1};  S_t = S~_t + beta_t k_t (v_t - S~_t^T k_t)^T;  o_t = scale S_t^T q_t
 *
 * Every tensor is described by an fgdn_tensor (strides in elements, like DLPack). A tensor
 * is absent iff its ndim is 0 (fgdn_tensor_none(), a zeroed struct); with ndim >= 1 it is
 * present, and its data pointer may be NULL only when it has no elements (an empty tensor is
 * a tensor: torch gives empty tensors a NULL data pointer). Every entry point validates all
 * of its arguments before it writes anything; on error it returns a non-zero status and
 * fgdn_last_error() names the argument, what was expected and what was given. The full
 * contract (sizes, layouts, overlaps, what synchronises) is in docs/api.md, "Contract".
 */
#ifndef FLASHGDN_FLASHGDN_H_
#define FLASHGDN_FLASHGDN_H_

#include <stddef.h>
#include <stdint.h>

/* FGDN_VERSION_MAJOR, _MINOR, _PATCH and FGDN_VERSION_STRING: the version of these headers,
   generated at configure time from the file VERSION. fgdn_version() is that of the library. */
#include "flashgdn/version.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define FGDN_API __declspec(dllexport)
#else
#define FGDN_API __attribute__((visibility("default")))
#endif

#define FGDN_MAX_DIMS 4

typedef enum fgdn_dtype {
  FGDN_FLOAT32 = 0,
  FGDN_FLOAT16 = 1,
  FGDN_BFLOAT16 = 2,
  FGDN_INT32 = 3,
  FGDN_INT64 = 4
} fgdn_dtype;

/* Same codes as DLPack's DLDeviceType. */
typedef enum fgdn_device_type { FGDN_CPU = 1, FGDN_CUDA = 2 } fgdn_device_type;

/* Accuracy of the CUDA backend's chunk arithmetic, in the forward (fgdn_fwd_args.precision) and
   the backward (fgdn_bwd_args.precision); the CPU backend computes in float32 always and takes
   every level alike. In the backward, DEFAULT and FAST take single 16-bit products with float32
   accumulation in the per-chunk gradient steps (the other steps still split), and HIGH splits
   the computed operands in every step (the backward at the rounding floor): docs/api.md. */
typedef enum fgdn_precision {
  FGDN_PRECISION_DEFAULT = 0, /* the library's choice: as fast as keeps o within the peers' error */
  FGDN_PRECISION_FAST = 1,    /* every tensor-core operand one 16-bit value (the peers' scheme) */
  FGDN_PRECISION_HIGH = 2     /* computed operands split in two 16-bit halves: o at the rounding
                                 floor of its dtype, about 1.4-1.7x the time of FAST (forward,
                                 measured on an H100, by shape) */
} fgdn_precision;

/* Intra-card context parallelism of the CUDA forward (docs/context-parallel.md): long sequences
   cut into segments that run on different SMs, their states joined exactly (a transfer-matrix
   scan) or, where the gate certifies it, by a warm-up start. The CPU backend ignores it. */
typedef enum fgdn_context_parallel {
  FGDN_CONTEXT_PARALLEL_AUTO = 0, /* when the shapes may leave SMs idle; the plan on the GPU
                                     decides whether and where to split (cost model) */
  FGDN_CONTEXT_PARALLEL_OFF = 1,  /* never: one CTA per (sequence, value head); a sequence's
                                     bits do not depend on the other sequences of the call */
  FGDN_CONTEXT_PARALLEL_ON = 2    /* always plan for it (sequences longer than a segment split) */
} fgdn_context_parallel;

typedef enum fgdn_status {
  FGDN_SUCCESS = 0,
  FGDN_ERROR_INVALID_ARGUMENT = 1, /* a caller's argument was rejected; nothing was written */
  FGDN_ERROR_NOT_SUPPORTED = 2,    /* valid, but this build or backend cannot run it */
  FGDN_ERROR_CUDA = 3,             /* a CUDA call failed */
  FGDN_ERROR_INTERNAL = 4
} fgdn_status;

/* A non-owning view of a strided tensor. ndim == 0 means "absent". Every element it
   addresses, data + sum_d i_d * strides[d] for 0 <= i_d < shape[d], must lie in memory the
   caller owns; outputs must not address one element twice nor share memory with another
   argument. */
typedef struct fgdn_tensor {
  void* data;          /* may be NULL only when some shape[d] is 0 */
  int32_t dtype;       /* fgdn_dtype */
  int32_t ndim;        /* 1 .. FGDN_MAX_DIMS; 0: absent */
  int64_t shape[FGDN_MAX_DIMS];
  int64_t strides[FGDN_MAX_DIMS]; /* in elements */
  int32_t device_type; /* fgdn_device_type */
  int32_t device_id;
} fgdn_tensor;

/* The inputs shared by forward and backward. */
typedef struct fgdn_inputs {
  fgdn_tensor q;    /* [B, T, Hq, K]  bf16 | fp16 | fp32 (q, k, v share one dtype) */
  fgdn_tensor k;    /* [B, T, Hq, K] */
  fgdn_tensor v;    /* [B, T, Hv, V] */
  fgdn_tensor g;    /* [B, T, Hv] fp32 | bf16 | fp16: log-space gate g <= 0; with gate_in_kernel the
                       raw activation a, and g = -exp(A_log[h]) * softplus(a + dt_bias[h]) */
  fgdn_tensor beta; /* [B, T, Hv] fp32 | bf16 | fp16 */
  fgdn_tensor A_log;   /* [Hv] fp32, required iff gate_in_kernel */
  fgdn_tensor dt_bias; /* [Hv] fp32, optional with gate_in_kernel (zero when absent) */
  fgdn_tensor cu_seqlens; /* [N + 1] int32 | int64, optional; requires B == 1 */
  /* Optional host copy of cu_seqlens (int32 | int64, [N + 1], on the CPU) for device calls:
     with it the call never reads cu_seqlens back from the device (no host synchronisation),
     which a CUDA graph capture needs. It must equal cu_seqlens: compared when cu_seqlens is
     on the CPU, trusted (and what validation checks) on a device unless in check mode. */
  fgdn_tensor cu_seqlens_host;
  fgdn_tensor initial_state; /* [N, Hv, K, V] fp32 | bf16 | fp16, optional; with state_indices
                                a pool [P, Hv, K, V] read (and, with output_final_state,
                                written) in place in its own dtype */
  fgdn_tensor state_indices; /* [N] int32 | int64, optional: row of the pool per sequence;
                                a negative index starts from zero and writes nothing back;
                                distinct non-negative rows when the pool is written */
  double scale;              /* used iff has_scale; default 1 / sqrt(K) */
  int32_t has_scale;
  int32_t use_qk_l2norm_in_kernel; /* q <- q / ||q||, k <- k / ||k|| (eps 1e-6) per token */
  int32_t gate_in_kernel;
  int32_t state_v_first; /* states are [.., V, K] instead of [.., K, V] */
  /* Check mode (0: off; also on when the environment variable FLASHGDN_CHECK_INPUTS is set to
     anything but "" or "0"): before anything is written, verify the inputs' values: q, k, v,
     g, beta, A_log, dt_bias, the initial states read (and d_o, d_final_state) finite; g <= 0
     unless gate_in_kernel; cu_seqlens equal to cu_seqlens_host; state_indices in range and,
     when the pool is written, distinct. A failure is FGDN_ERROR_INVALID_ARGUMENT naming the
     argument and the first offending element. Costs one host synchronisation on device
     tensors (not for CUDA graph capture). */
  int32_t check_inputs;
} fgdn_inputs;

typedef struct fgdn_fwd_args {
  fgdn_inputs in;
  int32_t output_final_state; /* write S_T: into final_state, or (with state_indices) back
                                 into the pool rows of initial_state */
  int64_t checkpoint_every;   /* 0: none; else a multiple of 64: S after every
                                 checkpoint_every tokens of each sequence into checkpoints */
  fgdn_tensor o;              /* [B, T, Hv, V], dtype of q */
  fgdn_tensor final_state;    /* [N, Hv, K, V] fp32 | bf16 | fp16 (its own dtype, not
                                 necessarily that of initial_state); required iff
                                 output_final_state and no state_indices, absent otherwise */
  /* [R, Hv, K, V] fp32 with R >= sum_n floor(len_n / checkpoint_every); sequence n's j-th
     checkpoint (j = 0, 1, ...) is row offset_n + j, offset_n = sum_{m < n} floor(len_m /
     checkpoint_every), the state after (j + 1) * checkpoint_every of its tokens. */
  fgdn_tensor checkpoints;
  int32_t precision; /* fgdn_precision */
  int32_t context_parallel; /* fgdn_context_parallel */
  int64_t cp_segment; /* tokens per segment, a positive multiple of 64; 0: the cost model's
                         choice. Fixing it makes a sequence's bits independent of the call's
                         other sequences under CP too. */
  /* Optional (training): the chunk-start states the CUDA backward of the same call would
     otherwise recompute, [R, Hv, K, V] bf16, row-major, R = fgdn_saved_states_rows(); allowed
     only where R > 0, not with checkpoints. Pass the same tensor as fgdn_bwd_args.saved_states.
     They come from the forward's `fast` kernel at both levels that allow them (o too). */
  fgdn_tensor saved_states;
} fgdn_fwd_args;

typedef struct fgdn_bwd_args {
  fgdn_inputs in;
  fgdn_tensor d_o;           /* [B, T, Hv, V], dtype of q */
  fgdn_tensor d_final_state; /* [N, Hv, K, V] fp32 | bf16 | fp16, optional (zero when absent) */
  fgdn_tensor dq;            /* [B, T, Hq, K], dtype of q (w.r.t. the raw q when l2norm) */
  fgdn_tensor dk;            /* [B, T, Hq, K], dtype of k */
  fgdn_tensor dv;            /* [B, T, Hv, V], dtype of v */
  fgdn_tensor dg;            /* [B, T, Hv], dtype of g (gradient of a with gate_in_kernel) */
  fgdn_tensor dbeta;         /* [B, T, Hv], dtype of beta */
  fgdn_tensor dA_log;        /* [Hv] fp32, required iff gate_in_kernel */
  fgdn_tensor ddt_bias;      /* [Hv] fp32, required iff gate_in_kernel and dt_bias given */
  fgdn_tensor dh0;           /* [N, Hv, K, V] fp32 | bf16 | fp16 (autograd: the dtype of
                                initial_state), optional (only with initial_state) */
  /* Last, so that the fields before them keep their offsets for callers built before them (a
     zero-initialised struct asks for FGDN_PRECISION_DEFAULT and FGDN_CONTEXT_PARALLEL_AUTO). */
  int32_t precision; /* fgdn_precision: the CUDA backward's arithmetic (as the forward's) */
  /* The reverse state-gradient pass of the CUDA backward split into segments, as the forward's
     (docs/context-parallel.md, the backward): OFF keeps one CTA per (sequence, value head) and
     a sequence's bits independent of the other sequences; a fixed cp_segment keeps them
     independent too. Autograd passes the forward call's values. */
  int32_t context_parallel; /* fgdn_context_parallel */
  int64_t cp_segment;       /* tokens per segment, 0 or a positive multiple of 64 (0: chosen) */
  /* Optional: fgdn_fwd_args.saved_states of the forward call on the same inputs at the same
     precision level (the library cannot check where they came from); the backward then skips
     its states pass. Refused where fgdn_saved_states_rows() is 0. */
  fgdn_tensor saved_states;
  /* 1: the backward may use saved_states' memory as scratch once it has read them (their values
     are undefined after the call; a second backward needs the forward's states again; they are
     then an output, overlapping no other argument). Where v, d_o and dv are TMA-addressable
     (docs/api.md) its workspace is then smaller by (R - 1) Hv K V 2 bytes (1.07 GB at 64 value
     heads, one 32768-token sequence; fgdn_backward_workspace_size). 0 (a zero-initialised
     struct): saved_states are only read. 1 only with saved_states. */
  int32_t saved_states_scratch;
} fgdn_bwd_args;

/* Device scratch the call needs, in bytes (0 for host tensors). Pass at least this much as
   workspace, or NULL to let the library allocate it on the stream. The size depends on the
   shapes only: the query validates everything but tensor values and reads no tensor memory
   (so it never touches a stream). */
FGDN_API fgdn_status fgdn_forward_workspace_size(const fgdn_fwd_args* args, size_t* bytes);
FGDN_API fgdn_status fgdn_backward_workspace_size(const fgdn_bwd_args* args, size_t* bytes);

/* stream: a cudaStream_t for device tensors (NULL: the default stream); ignored on the CPU. */
FGDN_API fgdn_status fgdn_forward(const fgdn_fwd_args* args, void* workspace,
                                  size_t workspace_bytes, void* stream);
FGDN_API fgdn_status fgdn_backward(const fgdn_bwd_args* args, void* workspace,
                                   size_t workspace_bytes, void* stream);

/* Rows R of the saved_states a forward call may write for its backward: > 0 where the CUDA
   backward of the same call takes them (bf16, K = V = 128, `fast` or `default`: the fused
   backward), else 0 (the backward recomputes its states). Validates as the workspace query. */
FGDN_API fgdn_status fgdn_saved_states_rows(const fgdn_fwd_args* args, int64_t* rows);

/* The message of the calling thread's last failed call ("" if none). */
FGDN_API const char* fgdn_last_error(void);
/* 1 if this build has the CUDA backend. */
FGDN_API int fgdn_has_cuda(void);
/* "MAJOR.MINOR.PATCH" of the loaded library: FGDN_VERSION_STRING when it was built. */
FGDN_API const char* fgdn_version(void);

/* An fgdn_tensor with every field zero (ndim 0): an absent optional tensor. */
static inline fgdn_tensor fgdn_tensor_none(void) {
  fgdn_tensor t;
  size_t i;
  unsigned char* p = (unsigned char*)&t;
  for (i = 0; i < sizeof(t); ++i) p[i] = 0;
  return t;
}

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FLASHGDN_FLASHGDN_H_ */
