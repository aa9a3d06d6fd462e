// pybind11 module pcie_allreduce._C. Thin: one register_* per concept. Pointers and streams cross
// as Python ints, so the module needs no torch headers and one build serves any torch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "protocol_constants.h"
#include "workspace.h"

namespace py = pybind11;
using pcie_ar::CallError;
using pcie_ar::Workspace;

namespace {

void register_runtime(py::module_& m) {
  m.def("device_count", &pcie_ar::device_count, "CUDA devices visible to this process (0 without a driver).");
  m.def("runtime_status", &pcie_ar::runtime_status, "Empty when CUDA is usable, otherwise the reason.");
  m.def("runtime_version", &pcie_ar::runtime_version, "CUDA runtime version this module was built with.");
  m.def("driver_version", &pcie_ar::driver_version, "CUDA driver version (0 without a driver).");
  m.def("pci_bus_id", &pcie_ar::pci_bus_id, py::arg("device"));
  m.def("device_by_pci_bus_id", &pcie_ar::device_by_pci_bus_id, py::arg("bus_id"),
        "Local ordinal of the GPU with that PCI bus id, or -1 when this process cannot see it.");
  m.def("can_access_peer", &pcie_ar::can_access_peer, py::arg("device"), py::arg("peer_device"));
  m.def("compiled_archs", &pcie_ar::compiled_archs, "SM versions (e.g. 900) compiled into this module.");
}

void register_errors(py::module_& m) {
  py::class_<CallError>(m, "CallError")
      .def_readonly("kind", &CallError::kind)
      .def_readonly("rank", &CallError::rank)
      .def_readonly("peer", &CallError::peer)
      .def_readonly("stage", &CallError::stage)
      .def_readonly("block", &CallError::block)
      .def_readonly("epoch", &CallError::epoch)
      .def_readonly("expected_signature", &CallError::expected_signature)
      .def_readonly("observed_signature", &CallError::observed_signature);
}

void register_workspace(py::module_& m) {
  py::class_<Workspace>(m, "Workspace")
      .def(py::init<int, int, int, uint64_t, double, int, const std::string&>(), py::arg("device"), py::arg("rank"),
           py::arg("world"), py::arg("max_bytes"), py::arg("timeout_s"), py::arg("transport") = 0,
           py::arg("segment_name") = "")
      .def("ipc_handle", [](const Workspace& w) { return py::bytes(w.ipc_handle()); })
      .def("open_peers",
           [](Workspace& w, const std::vector<py::bytes>& handles) {
             std::vector<std::string> raw;
             raw.reserve(handles.size());
             for (const auto& h : handles) raw.emplace_back(h);
             w.open_peers(raw);
           })
      .def("release_name", &Workspace::release_name,
           "Host transport: unlink the /dev/shm name once every rank mapped it (no-op for p2p).")
      .def_property_readonly("transport", &Workspace::transport)
      .def("write_probes", &Workspace::write_probes, py::arg("seed"),
           "Store a pattern into this rank's data slot of every peer (the creation-time transfer test).")
      .def("probe_failures", &Workspace::probe_failures, py::arg("seed"),
           "After every rank wrote its probes: the ranks whose pattern did not arrive here.")
      .def("all_reduce", &Workspace::all_reduce, py::arg("algo"), py::arg("input"), py::arg("output"),
           py::arg("nbytes"), py::arg("dtype"), py::arg("blocks"), py::arg("stream"),
           "Enqueue one all-reduce; returns a non-zero error kind (and launches nothing) once a call failed.")
      .def("error", &Workspace::error)
      .def("failed", &Workspace::failed, "Recorded error kind (0: none); no CUDA call.")
      .def("signature", &Workspace::signature)
      .def_property("timeout", &Workspace::timeout, &Workspace::set_timeout)
      .def_property("island_ranks", &Workspace::island_ranks, &Workspace::set_island_ranks,
                    "ranks per island for island_twoshot (consecutive islands of that many ranks); 0: none")
      .def_property("dependent_launch", &Workspace::dependent_launch, &Workspace::set_dependent_launch,
                    "launch calls as the previous kernel's programmatic dependent (Hopper and later)")
      .def("bases", &Workspace::bases)
      .def_property_readonly("peers_table_ptr", &Workspace::peers_table_device_ptr,
                             "device address of bases() as uint64[MAX_RANKS], written when the peers are opened")
      .def_property_readonly("error_record_ptr", &Workspace::error_record_device_ptr)
      .def_property_readonly("slot_bytes", &Workspace::slot_bytes)
      .def_property_readonly("parity_bytes", &Workspace::parity_bytes)
      .def_property_readonly("ll_capacity", &Workspace::ll_capacity)
      .def_property_readonly("ll_slot_bytes", &Workspace::ll_slot_bytes)
      .def_property_readonly("ll_offset", &Workspace::ll_offset)
      .def_property_readonly("flags_offset", &Workspace::flags_offset)
      .def_property_readonly("control_offset", &Workspace::control_offset)
      .def_property_readonly("stats_offset", &Workspace::stats_offset)
      .def_property_readonly("local_base", &Workspace::local_base)
      .def_property_readonly("shared_offset", &Workspace::shared_offset)
      .def_property_readonly("shared_bytes", &Workspace::shared_bytes)
      .def_property_readonly("full_offset", &Workspace::full_offset)
      .def_property_readonly("full_bytes", &Workspace::full_bytes)
      .def_property_readonly("input_offset", &Workspace::input_offset)
      .def_property_readonly("input_bytes", &Workspace::input_bytes)
      .def_property_readonly("total_bytes", &Workspace::total_bytes)
      .def_property_readonly("device", &Workspace::device)
      .def_property_readonly("rank", &Workspace::rank)
      .def_property_readonly("world", &Workspace::world)
      .def_property_readonly("max_bytes", &Workspace::max_bytes)
      .def("debug_set_epoch", &Workspace::debug_set_epoch)
      .def("debug_epoch", &Workspace::debug_epoch)
      .def("debug_delay_probes", &Workspace::debug_delay_probes, py::arg("seconds"),
           "Test hook: write_probes' kernel then waits this long (GPU clock) before its stores; 0: no wait.")
      .def_property_readonly("abandoned", &Workspace::abandoned,
                             "close() left the memory allocated: a transfer test's kernel was still running.")
      .def("note_capture", &Workspace::note_capture, py::arg("stream"),
           "Whether `stream` is being captured into a CUDA graph (remembered: see `captured`).")
      .def_property_readonly("captured", &Workspace::captured,
                             "A CUDA graph capture recorded a call on this workspace: retire(), never close().")
      .def("retire", &Workspace::retire,
           "close() for a workspace a graph may replay: abort word raised, peers unmapped, own memory kept.")
      .def("close", &Workspace::close);
  m.def(
      "p2p_export",
      [](const py::bytes& ipc_handle, uint64_t bytes) {
        return py::bytes(pcie_ar::p2p_export(std::string(ipc_handle), bytes));
      },
      py::arg("ipc_handle"), py::arg("bytes"),
      "What Workspace.ipc_handle() returns on p2p: the 64-byte CUDA IPC handle, then the workspace's size.");
  m.def(
      "p2p_import",
      [](const py::bytes& blob, uint64_t expected_bytes, int rank, int peer) {
        return py::bytes(pcie_ar::p2p_import(std::string(blob), expected_bytes, rank, peer));
      },
      py::arg("blob"), py::arg("expected_bytes"), py::arg("rank"), py::arg("peer"),
      "The IPC handle in rank `peer`'s p2p export; raises unless it names a workspace of exactly expected_bytes.");
}

// {name: id} (or {id: name} with by_id) from one of protocol_constants.h's name tables.
template <typename Id, size_t N>
py::dict names_table(const pcie_ar::Named<Id> (&table)[N], bool by_id = false) {
  py::dict out;
  for (const auto& entry : table) {
    const auto id = static_cast<int64_t>(entry.id);
    if (by_id) {
      out[py::int_(id)] = entry.name;
    } else {
      out[entry.name] = id;
    }
  }
  return out;
}

// The algorithm records (kAlgorithms), one dict each in id order, under the field names of
// Python's records (pcie_allreduce/plan/algorithms.py, Algorithm), which are checked against them.
py::list algorithm_records() {
  py::list out;
  for (const auto& r : pcie_ar::kAlgorithms) {
    out.append(py::dict(
        py::arg("name") = r.name, py::arg("id") = static_cast<int>(r.id),
        py::arg("transport") = r.has(pcie_ar::kAlgoHostOnly) ? py::object(py::str("host")) : py::object(py::none()),
        py::arg("capacity_margin") =
            r.has(pcie_ar::kAlgoCapped) ? py::object(py::int_(r.capacity_margin)) : py::object(py::none()),
        py::arg("island") = r.has(pcie_ar::kAlgoIsland), py::arg("symmetric_input") = r.has(pcie_ar::kAlgoSymmetricInput),
        py::arg("compressed_wire") = r.has(pcie_ar::kAlgoFp8Wire) ? py::object(py::str("fp8")) : py::object(py::none())));
  }
  return out;
}

// Every value Python mirrors in pcie_allreduce/constants.py, from its C++ name.
void register_constants(py::module_& m) {
  m.attr("MIN_RANKS") = pcie_ar::kMinRanks;
  m.attr("MAX_RANKS") = pcie_ar::kMaxRanks;
  m.attr("SMALL_WORLD") = pcie_ar::kSmallWorld;
  m.attr("MAX_MESSAGE_BYTES") = pcie_ar::kMaxMessageBytes;
  m.attr("MAX_TIMEOUT_S") = pcie_ar::kMaxTimeoutSeconds;
  m.attr("MAX_LAUNCH_BLOCKS") = pcie_ar::kMaxLaunchBlocks;
  m.attr("MAX_FLAG_BLOCKS") = pcie_ar::kMaxFlagBlocks;
  m.attr("THREADS_PER_BLOCK") = pcie_ar::kThreadsPerBlock;
  m.attr("FLAG_KINDS") = pcie_ar::kFlagKinds;
  m.attr("NOTICE_KIND") = pcie_ar::kNoticeKind;
  m.attr("FLAG_ROWS") = pcie_ar::kFlagRows;
  m.attr("ALIGN") = pcie_ar::kAlign;
  m.attr("LOW_LATENCY_MAX_BYTES") = pcie_ar::kLowLatencyMaxBytes;
  m.attr("ROW_STATS_SLOTS") = pcie_ar::kRowStatsSlots;
  m.attr("LINE_PAYLOAD_BYTES") = pcie_ar::kLinePayloadBytes;
  m.attr("LINE_BYTES") = pcie_ar::kLineBytes;
  m.attr("LINE_FLAG_MIX") = pcie_ar::kLineFlagMix;
  m.attr("WRAP_SEAL_MIX") = pcie_ar::kWrapSealMix;
  m.attr("EPOCH_COPIES") = pcie_ar::kEpochCopies;
  m.attr("ABORT_WORD") = pcie_ar::kAbortWord;
  m.attr("CLAIM_WORD") = pcie_ar::kClaimWord;
  m.attr("SHARED_STATE_WORDS") = pcie_ar::kSharedStateWords;
  m.attr("SHARED_BUFFERS") = pcie_ar::kSharedBuffers;
  m.attr("SHARED_AREAS") = pcie_ar::kSharedAreas;
  m.attr("SHARED_HEADER_BYTES") = pcie_ar::kSharedHeaderBytes;
  m.attr("FULL_HEADER_BYTES") = pcie_ar::kFullHeaderBytes;
  m.attr("FULL_TWOSHOT_MARGIN") = pcie_ar::kFullTwoShotMargin;
  m.attr("POISON_WORD") = pcie_ar::kPoisonWord;
  m.attr("FP8_BLOCK") = pcie_ar::kFp8Block;
  m.attr("CONTROL_WORDS") = pcie_ar::kControlWords;
  m.attr("ERROR_WORDS") = pcie_ar::kErrorRecordWords;
  m.attr("ALGO_RECORDS") = algorithm_records();
  m.attr("DTYPE_IDS") = names_table(pcie_ar::kDTypeNames);
  m.attr("ERROR_KINDS") = names_table(pcie_ar::kErrorKindNames);
  m.attr("TRANSPORT_IDS") = names_table(pcie_ar::kTransportNames);
  m.attr("STAGE_NAMES") = names_table(pcie_ar::kStageNames, /*by_id=*/true);
  m.def(
      "layout",
      [](uint64_t max_bytes, int world, int transport) {
        const auto l = pcie_ar::Layout::make(max_bytes, world, static_cast<pcie_ar::Transport>(transport));
        return py::dict(py::arg("slot_bytes") = l.slot_bytes, py::arg("parity_bytes") = l.parity_bytes,
                        py::arg("ll_capacity") = l.ll_capacity, py::arg("ll_slot_bytes") = l.ll_slot_bytes,
                        py::arg("ll_offset") = l.ll_offset, py::arg("flags_offset") = l.flags_offset,
                        py::arg("control_offset") = l.control_offset, py::arg("stats_offset") = l.stats_offset,
                        py::arg("shared_offset") = l.shared_offset, py::arg("shared_bytes") = l.shared_bytes,
                        py::arg("full_offset") = l.full_offset, py::arg("full_bytes") = l.full_bytes,
                        py::arg("input_offset") = l.input_offset, py::arg("input_bytes") = l.input_bytes,
                        py::arg("total_bytes") = l.total_bytes);
      },
      py::arg("max_bytes"), py::arg("world"), py::arg("transport") = 0,
      "Byte offsets of Layout::make(max_bytes, world, transport): the workspace layout every kernel uses.");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "pcie_allreduce CUDA kernels (P2P one-shot, staged and two-shot all-reduce)";
  register_runtime(m);
  register_errors(m);
  register_workspace(m);
  register_constants(m);
}
