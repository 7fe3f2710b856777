// Checkpoint rows of a varlen batch, on the device (no host synchronisation): see chunk_index.cuh.
#include "cuda/chunk_index.cuh"

namespace flashgdn::cuda {
namespace {

// offset_n = sum_{m < n} floor(len_m / every): one block, sequential runs per thread, then an
// exclusive scan of the runs' sums.
__global__ void __launch_bounds__(1024) checkpoint_offsets_kernel(SeqLayout seq, int64_t every,
                                                                  int64_t* out) {
  __shared__ int64_t part[1024];
  const int64_t per = ceil_div(seq.N, 1024);
  const int64_t a = threadIdx.x * per;
  const int64_t e = seq.N < a + per ? seq.N : a + per;
  int64_t s = 0;
  for (int64_t m = a; m < e; ++m) s += seq_info(seq, m).len / every;
  part[threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t run = 0;
    for (int i = 0; i < 1024; ++i) {
      const int64_t x = part[i];
      part[i] = run;
      run += x;
    }
  }
  __syncthreads();
  s = part[threadIdx.x];
  for (int64_t m = a; m < e; ++m) {
    out[m] = s;
    s += seq_info(seq, m).len / every;
  }
}

}  // namespace

void launch_checkpoint_offsets(const SeqLayout& seq, int64_t every, int64_t* out, cudaStream_t stream) {
  checkpoint_offsets_kernel<<<1, 1024, 0, stream>>>(seq, every, out);
  FGDN_CHECK_LAUNCH("checkpoint_offsets_kernel");
}

}  // namespace flashgdn::cuda
