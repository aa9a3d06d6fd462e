// Pinned host memory that every rank of one host maps: the memory of the host transport.
//
// A POSIX shared-memory segment (/dev/shm), registered with CUDA as mapped and portable, so a
// kernel on any GPU of this process reads and writes it through a device pointer and its stores
// cross that GPU's own PCIe link. The owner creates it under a name the others open; the name is
// unlinked as soon as every rank has mapped it (release_name), so a rank that dies afterwards
// leaves nothing in /dev/shm. The caller names the segment (pcie_allreduce/transport.py): the
// name carries its creator's identity, so a later communicator can remove segments a killed
// process left before the unlink.
// Plain C++ with the CUDA runtime only (no kernels), like workspace.h.
#pragma once

#include <cstdint>
#include <string>

namespace pcie_ar {

class HostSegment {
 public:
  HostSegment() = default;
  ~HostSegment();
  HostSegment(const HostSegment&) = delete;
  HostSegment& operator=(const HostSegment&) = delete;

  // Create and register a zero-filled segment of `bytes` named `name` in /dev/shm (no slash; it
  // must not exist yet). Throws with the reason (no space in /dev/shm names its size) and
  // leaves nothing behind on failure.
  void create(const std::string& name, uint64_t bytes);
  // Map and register a peer's segment; its size must be exactly `bytes` (the layout every rank
  // agreed on), else it is not the segment this communicator expects.
  void open(const std::string& name, uint64_t bytes);
  // Remove the name from /dev/shm (the mapping stays). Idempotent; close() does it too.
  void release_name();
  // Unregister, unmap and release the name. Idempotent; the destructor calls it.
  void close();

  char* device_pointer() const { return device_; }
  char* host_pointer() const { return host_; }
  const std::string& name() const { return name_; }
  uint64_t bytes() const { return bytes_; }
  bool is_open() const { return host_ != nullptr; }

 private:
  void map_and_register(int fd, const std::string& what);

  std::string name_;
  bool owns_name_ = false;  // created here and not yet unlinked
  char* host_ = nullptr;
  char* device_ = nullptr;
  uint64_t bytes_ = 0;
  bool registered_ = false;
};

}  // namespace pcie_ar
