#include "host_segment.h"

#include <cuda_runtime.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <stdexcept>

namespace pcie_ar {

namespace {

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

}  // namespace

HostSegment::~HostSegment() { close(); }

void HostSegment::create(const std::string& name, uint64_t bytes) {
  if (is_open()) throw std::runtime_error("host segment already open");
  // One file directly in /dev/shm: a slash would name another directory (or none).
  if (name.empty() || name.size() > NAME_MAX || name.find('/') != std::string::npos) {
    throw std::runtime_error("host segment name '" + name + "' must be 1 to " + std::to_string(NAME_MAX) +
                             " characters without '/'");
  }
  name_ = "/" + name;
  bytes_ = bytes;
  const int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw std::runtime_error("shm_open(" + name_ + ") failed: " + errno_text(errno));
  owns_name_ = true;
  try {
    // posix_fallocate reserves the pages now: a /dev/shm too small for the workspace fails here
    // with ENOSPC instead of a SIGBUS at the first touch. The pages read as zero (flags never
    // written: epoch 0, older than any call).
    const int err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    if (err != 0) {
      throw std::runtime_error("reserving " + std::to_string(bytes >> 20) + " MiB of pinned host memory in /dev/shm (" +
                               name_ + ") failed: " + errno_text(err) +
                               (err == ENOSPC ? "; /dev/shm is too small for this max_bytes (a container needs a "
                                                "larger --shm-size, or use a smaller max_bytes)"
                                              : ""));
    }
    map_and_register(fd, "creating");
  } catch (...) {
    ::close(fd);
    close();
    throw;
  }
  ::close(fd);
}

void HostSegment::open(const std::string& name, uint64_t bytes) {
  if (is_open()) throw std::runtime_error("host segment already open");
  name_ = name;
  bytes_ = bytes;
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) {
    throw std::runtime_error("shm_open(" + name + ") failed: " + errno_text(errno) +
                             "; the host transport needs every rank on one host, sharing /dev/shm");
  }
  try {
    struct stat st {};
    if (fstat(fd, &st) != 0) throw std::runtime_error("fstat(" + name + ") failed: " + errno_text(errno));
    if (static_cast<uint64_t>(st.st_size) != bytes) {
      throw std::runtime_error("host segment " + name + " has " + std::to_string(st.st_size) + " bytes, the layout " +
                               "every rank agreed on has " + std::to_string(bytes));
    }
    map_and_register(fd, "opening");
  } catch (...) {
    ::close(fd);
    close();
    throw;
  }
  ::close(fd);
}

void HostSegment::map_and_register(int fd, const std::string& what) {
  void* host = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (host == MAP_FAILED) throw std::runtime_error("mmap(" + name_ + ") failed: " + errno_text(errno));
  host_ = static_cast<char*>(host);
  // Portable: every CUDA context of this process may use it; mapped: kernels reach it through a
  // device pointer (their loads and stores cross the GPU's PCIe link).
  cudaError_t err = cudaHostRegister(host_, bytes_, cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(what + " host segment " + name_ + ": cudaHostRegister failed: " + cudaGetErrorName(err) +
                             " (" + cudaGetErrorString(err) + ")");
  }
  registered_ = true;
  void* device = nullptr;
  err = cudaHostGetDevicePointer(&device, host_, 0);
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(what + " host segment " + name_ + ": cudaHostGetDevicePointer failed: " +
                             cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
  }
  device_ = static_cast<char*>(device);
}

void HostSegment::release_name() {
  if (owns_name_) shm_unlink(name_.c_str());
  owns_name_ = false;
}

void HostSegment::close() {
  if (registered_) cudaHostUnregister(host_);
  registered_ = false;
  if (host_ != nullptr) munmap(host_, bytes_);
  host_ = nullptr;
  device_ = nullptr;
  release_name();
}

}  // namespace pcie_ar
