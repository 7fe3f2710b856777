// The C ABI entry points: validate, dispatch to the backend of the tensors' device, and turn
// every exception into a status code plus a thread-local message.
#include <exception>
#include <new>
#include <string>

#include "api/validate.h"
#include "common/error.h"
#include "cpu/cpu_backend.h"
#include "flashgdn/flashgdn.h"
#ifdef FLASHGDN_WITH_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace {

thread_local std::string g_last_error;

fgdn_status set_error(fgdn_status s, const std::string& msg) {
  g_last_error = msg;
  return s;
}

// Runs f, mapping exceptions to statuses. Validation errors are InvalidArgument (nothing was
// written), NotSupported means a valid call this build cannot run.
template <class F>
fgdn_status guarded(F&& f) {
  try {
    f();
    g_last_error.clear();
    return FGDN_SUCCESS;
  } catch (const flashgdn::InvalidArgument& e) {
    return set_error(FGDN_ERROR_INVALID_ARGUMENT, e.what());
  } catch (const flashgdn::NotSupported& e) {
    return set_error(FGDN_ERROR_NOT_SUPPORTED, e.what());
  } catch (const std::bad_alloc&) {
    return set_error(FGDN_ERROR_INTERNAL, "flashgdn: out of host memory");
#ifdef FLASHGDN_WITH_CUDA
  } catch (const flashgdn::cuda::CudaError& e) {
    return set_error(FGDN_ERROR_CUDA, e.what());
#endif
  } catch (const std::exception& e) {
    return set_error(FGDN_ERROR_INTERNAL, e.what());
  } catch (...) {
    return set_error(FGDN_ERROR_INTERNAL, "flashgdn: unknown error");
  }
}


#ifdef FLASHGDN_WITH_CUDA
void require_workspace(size_t needed, void* workspace, size_t bytes) {
  if (needed > 0 && workspace != nullptr && bytes < needed)
    throw flashgdn::InvalidArgument("flashgdn: argument 'workspace_bytes': expected at least " +
                                    std::to_string(needed) + " bytes, got " +
                                    std::to_string(bytes));
}

// Runs f with the caller's workspace, or with stream-ordered scratch when none was given.
template <class F>
void with_workspace(const flashgdn::Problem& p, size_t needed, void* workspace, void* stream,
                    F&& f) {
  if (needed == 0 || workspace != nullptr) {
    f(workspace);
    return;
  }
  void* ws = flashgdn::cuda::workspace_alloc(needed, p.device_id, stream);
  try {
    f(ws);
  } catch (...) {
    flashgdn::cuda::workspace_free(ws, stream);
    throw;
  }
  flashgdn::cuda::workspace_free(ws, stream);
}
#endif

}  // namespace

extern "C" {

fgdn_status fgdn_forward_workspace_size(const fgdn_fwd_args* args, size_t* bytes) {
  return guarded([&] {
    if (bytes == nullptr)
      throw flashgdn::InvalidArgument("fgdn_forward_workspace_size: argument 'bytes': expected a pointer, got NULL");
    const flashgdn::Problem p = flashgdn::validate_forward(args, flashgdn::Mode::kShapes, nullptr);
    *bytes = 0;
#ifdef FLASHGDN_WITH_CUDA
    if (p.on_cuda) *bytes = flashgdn::cuda::forward_workspace_size(p, *args);
#endif
    (void)p;
  });
}

fgdn_status fgdn_backward_workspace_size(const fgdn_bwd_args* args, size_t* bytes) {
  return guarded([&] {
    if (bytes == nullptr)
      throw flashgdn::InvalidArgument("fgdn_backward_workspace_size: argument 'bytes': expected a pointer, got NULL");
    const flashgdn::Problem p = flashgdn::validate_backward(args, flashgdn::Mode::kShapes, nullptr);
    *bytes = 0;
#ifdef FLASHGDN_WITH_CUDA
    if (p.on_cuda) *bytes = flashgdn::cuda::backward_workspace_size(p, *args);
#endif
    (void)p;
  });
}

fgdn_status fgdn_saved_states_rows(const fgdn_fwd_args* args, int64_t* rows) {
  return guarded([&] {
    if (rows == nullptr)
      throw flashgdn::InvalidArgument("fgdn_saved_states_rows: argument 'rows': expected a pointer, got NULL");
    *rows = flashgdn::saved_states_rows(flashgdn::validate_forward(args, flashgdn::Mode::kShapes, nullptr));
  });
}

fgdn_status fgdn_forward(const fgdn_fwd_args* args, void* workspace, size_t workspace_bytes,
                         void* stream) {
  return guarded([&] {
    const flashgdn::Problem p =
        flashgdn::validate_forward(args, flashgdn::Mode::kCall, stream, workspace, workspace_bytes);
    if (!p.on_cuda) {
      flashgdn::cpu::forward(p, *args);
      return;
    }
#ifdef FLASHGDN_WITH_CUDA
    flashgdn::cuda::raise_pending_error();
    const size_t needed = flashgdn::cuda::forward_workspace_size(p, *args);
    require_workspace(needed, workspace, workspace_bytes);
    with_workspace(p, needed, workspace, stream,
                   [&](void* ws) { flashgdn::cuda::forward(p, *args, ws, stream); });
#else
    (void)workspace, (void)workspace_bytes;
#endif
  });
}

fgdn_status fgdn_backward(const fgdn_bwd_args* args, void* workspace, size_t workspace_bytes,
                          void* stream) {
  return guarded([&] {
    const flashgdn::Problem p =
        flashgdn::validate_backward(args, flashgdn::Mode::kCall, stream, workspace, workspace_bytes);
    if (!p.on_cuda) {
      flashgdn::cpu::backward(p, *args);
      return;
    }
#ifdef FLASHGDN_WITH_CUDA
    flashgdn::cuda::raise_pending_error();
    const size_t needed = flashgdn::cuda::backward_workspace_size(p, *args);
    require_workspace(needed, workspace, workspace_bytes);
    with_workspace(p, needed, workspace, stream,
                   [&](void* ws) { flashgdn::cuda::backward(p, *args, ws, stream); });
#else
    (void)workspace, (void)workspace_bytes;
#endif
  });
}

const char* fgdn_last_error(void) { return g_last_error.c_str(); }

int fgdn_has_cuda(void) {
#ifdef FLASHGDN_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

const char* fgdn_version(void) { return FGDN_VERSION_STRING; }

}  // extern "C"
