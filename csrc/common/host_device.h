// FGDN_HOST_DEVICE: functions shared by host code and CUDA kernels.
#pragma once

#ifdef __CUDACC__
#define FGDN_HOST_DEVICE __host__ __device__
#else
#define FGDN_HOST_DEVICE
#endif
