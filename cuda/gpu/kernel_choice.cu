// The kernel choice of kernel_choice.h: environment overrides read once, the device asked once.
#include "gpu/kernel_choice.h"

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdlib>
#include <optional>

namespace jax_flash::cuda {
namespace {

constexpr const char* kForwardVariable = "JAX_FLASH_CUDA_FORWARD";
constexpr const char* kBackwardVariable = "JAX_FLASH_CUDA_BACKWARD";
constexpr const char* kNarrowVariable = "JAX_FLASH_CUDA_NARROW";
constexpr const char* kOrderVariable = "JAX_FLASH_CUDA_ORDER";
constexpr const char* kHeadDim96Variable = "JAX_FLASH_CUDA_HD96";
constexpr const char* kHeadDim192BackwardVariable = "JAX_FLASH_CUDA_HD192_BWD";
constexpr const char* kValueHeadDimVariable = "JAX_FLASH_CUDA_VALUE_HEAD_DIM";
constexpr const char* kDecodeLoadsVariable = "JAX_FLASH_CUDA_DECODE_LOADS";
constexpr const char* kBiasLoadsVariable = "JAX_FLASH_CUDA_BIAS_LOADS";
constexpr const char* kForwardGridVariable = "JAX_FLASH_CUDA_FWD_GRID";
constexpr const char* kForwardRowsVariable = "JAX_FLASH_CUDA_FWD_ROWS";
constexpr const char* kUnseenBlocksVariable = "JAX_FLASH_CUDA_FWD_UNSEEN";
constexpr const char* kForwardStoresVariable = "JAX_FLASH_CUDA_FWD_STORES";

struct Overrides {
  std::optional<KernelFamily> forward;
  std::optional<KernelFamily> backward;
  bool narrow_split = true;  // JAX_FLASH_CUDA_NARROW=off turns it off
  bool longest_first = true;  // JAX_FLASH_CUDA_ORDER=grid turns it off
  bool native_head_dim_96 = true;  // JAX_FLASH_CUDA_HD96=padded turns it off
  HeadDim192Backward head_dim_192_backward = HeadDim192Backward::kNative;
  bool own_value_head_dim = true;  // JAX_FLASH_CUDA_VALUE_HEAD_DIM=padded turns it off
  DecodeLoads decode_loads = DecodeLoads::kPlain;
  BiasLoads bias_loads = BiasLoads::kTma;
  std::optional<QueryTileGrid> forward_grid;  // JAX_FLASH_CUDA_FWD_GRID=measured (or unset): none
  bool end_aligned_rows = true;  // JAX_FLASH_CUDA_FWD_ROWS=start turns it off
  bool skip_unseen_blocks = true;  // JAX_FLASH_CUDA_FWD_UNSEEN=compute turns it off
  bool vector_stores = true;  // JAX_FLASH_CUDA_FWD_STORES=pairs turns it off
  std::string error;
};

// Appends to `error` that `variable`'s value `value` is not one of `choices`.
void append_unknown_value(std::string& error, const char* variable, const std::string& value, const char* choices) {
  error += std::string(error.empty() ? "" : "; ") + "jax_flash: " + variable + "=" + value + " is not one of " +
           choices;
}

// The family `variable` names, if set (forward: whether the forward-only families are
// allowed); a value that names none is appended to `error`.
std::optional<KernelFamily> read_override(const char* variable, bool forward, std::string& error) {
  const char* value = std::getenv(variable);
  if (value == nullptr || *value == '\0') return std::nullopt;
  const std::string v = value;
  if (v == "sm80") return KernelFamily::kSm80;
  if (v == "sm90ws") return KernelFamily::kSm90Ws;
  if (forward && v == "sm90ws_narrow") return KernelFamily::kSm90WsNarrow;
  if (forward && v == "sm90ws_wide") return KernelFamily::kSm90WsWide;
  if (forward && v == "sm90ws_alusums") return KernelFamily::kSm90WsAluSums;
  if (forward && v == "sm90ws_directstore") return KernelFamily::kSm90WsDirectStore;
  if (!forward && v == "sm90ws_atomicdq") return KernelFamily::kSm90WsAtomicDq;
  if (!forward && v == "sm90ws_bulkdq") return KernelFamily::kSm90WsBulkDq;
  if (!forward && v == "sm90ws_tileddq") return KernelFamily::kSm90WsTiledDq;
  if (!forward && v == "sm90ws_m80") return KernelFamily::kSm90WsM80;
  if (!forward && v == "sm90ws_deferdq") return KernelFamily::kSm90WsDeferDq;
  if (!forward && v == "sm90ws_stagedq") return KernelFamily::kSm90WsStageDq;
  append_unknown_value(error, variable, v,
                       forward ? "sm80, sm90ws, sm90ws_narrow, sm90ws_wide, sm90ws_alusums, sm90ws_directstore"
                               : "sm80, sm90ws, sm90ws_atomicdq, sm90ws_bulkdq, sm90ws_tileddq, sm90ws_m80, sm90ws_deferdq, sm90ws_stagedq");
  return std::nullopt;
}

// The index of `variable`'s value in `values`: 0 (the default) where unset or empty; another
// value is appended to `error` (with the values it takes) and reads as 0.
template <size_t kValues>
size_t read_choice(const char* variable, const char* const (&values)[kValues], std::string& error) {
  const char* value = std::getenv(variable);
  if (value == nullptr || *value == '\0') return 0;
  std::string choices;
  for (size_t i = 0; i < kValues; ++i) {
    if (std::string(value) == values[i]) return i;
    choices += std::string(i ? ", " : "") + values[i];
  }
  append_unknown_value(error, variable, value, choices.c_str());
  return 0;
}

// A two-valued switch: false where `variable` is set to `off_value`, true where unset or set to
// `on_value`.
bool read_switch(const char* variable, const char* on_value, const char* off_value, std::string& error) {
  const char* const values[] = {on_value, off_value};
  return read_choice(variable, values, error) == 0;
}

// JAX_FLASH_CUDA_HD192_BWD: native where unset.
HeadDim192Backward read_head_dim_192_backward(std::string& error) {
  const char* const values[] = {"native", "padded", "sm80"};
  constexpr HeadDim192Backward kChoices[] = {HeadDim192Backward::kNative, HeadDim192Backward::kPadded,
                                             HeadDim192Backward::kSm80};
  return kChoices[read_choice(kHeadDim192BackwardVariable, values, error)];
}

// JAX_FLASH_CUDA_DECODE_LOADS: plain where unset.
DecodeLoads read_decode_loads(std::string& error) {
  const char* const values[] = {"plain", "evict_first", "prefetch256"};
  constexpr DecodeLoads kChoices[] = {DecodeLoads::kPlain, DecodeLoads::kEvictFirst, DecodeLoads::kPrefetch256};
  return kChoices[read_choice(kDecodeLoadsVariable, values, error)];
}

// JAX_FLASH_CUDA_BIAS_LOADS: staged where unset.
BiasLoads read_bias_loads(std::string& error) {
  const char* const values[] = {"tma", "staged", "direct"};
  constexpr BiasLoads kChoices[] = {BiasLoads::kTma, BiasLoads::kStaged, BiasLoads::kDirect};
  return kChoices[read_choice(kBiasLoadsVariable, values, error)];
}

// JAX_FLASH_CUDA_FWD_GRID: none (measured) where unset.
std::optional<QueryTileGrid> read_forward_grid(std::string& error) {
  const char* const values[] = {"measured", "per_tile", "static", "dynamic"};
  constexpr std::optional<QueryTileGrid> kChoices[] = {std::nullopt, QueryTileGrid::kPerTile,
                                                       QueryTileGrid::kStaticPairs, QueryTileGrid::kDynamic};
  return kChoices[read_choice(kForwardGridVariable, values, error)];
}

Overrides read_overrides() {
  Overrides o;
  o.forward = read_override(kForwardVariable, true, o.error);
  o.backward = read_override(kBackwardVariable, false, o.error);
  o.narrow_split = read_switch(kNarrowVariable, "split", "off", o.error);
  o.longest_first = read_switch(kOrderVariable, "longest", "grid", o.error);
  o.native_head_dim_96 = read_switch(kHeadDim96Variable, "native", "padded", o.error);
  o.head_dim_192_backward = read_head_dim_192_backward(o.error);
  o.own_value_head_dim = read_switch(kValueHeadDimVariable, "native", "padded", o.error);
  o.decode_loads = read_decode_loads(o.error);
  o.bias_loads = read_bias_loads(o.error);
  o.forward_grid = read_forward_grid(o.error);
  o.end_aligned_rows = read_switch(kForwardRowsVariable, "end", "start", o.error);
  o.skip_unseen_blocks = read_switch(kUnseenBlocksVariable, "skip", "compute", o.error);
  o.vector_stores = read_switch(kForwardStoresVariable, "vectors", "pairs", o.error);
  return o;
}

const Overrides& overrides() {
  static const Overrides o = read_overrides();
  return o;
}

// A device attribute of the current device, asked once per device (no stream work, so safe
// while XLA captures a CUDA graph); 0 if CUDA cannot say.
template <cudaDeviceAttr kAttribute>
int device_attribute() {
  constexpr int kMaxDevices = 64;
  static int values[kMaxDevices] = {};  // 0: not asked yet
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return 0;
  if (values[device] == 0) {
    int value = 0;
    if (cudaDeviceGetAttribute(&value, kAttribute, device) != cudaSuccess) return 0;
    values[device] = value;
  }
  return values[device];
}

// On Hopper the pass's Hopper family (`hopper`) unless overridden; else mma.sync.
KernelFamily choose(std::optional<KernelFamily> override_family, KernelFamily hopper) {
  return device_compute_major() == 9 ? override_family.value_or(hopper) : KernelFamily::kSm80;
}

}  // namespace

const std::string& kernel_override_error() { return overrides().error; }

int device_compute_major() { return device_attribute<cudaDevAttrComputeCapabilityMajor>(); }
int device_sm_count() { return device_attribute<cudaDevAttrMultiProcessorCount>(); }
int device_max_smem_per_block() { return device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(); }

KernelFamily forward_family() { return choose(overrides().forward, KernelFamily::kSm90Ws); }
KernelFamily backward_family() { return choose(overrides().backward, KernelFamily::kSm90Ws); }
bool narrow_split_enabled() { return overrides().narrow_split; }
bool longest_first_enabled() { return overrides().longest_first; }
bool native_head_dim_96_enabled() { return overrides().native_head_dim_96; }
HeadDim192Backward head_dim_192_backward() { return overrides().head_dim_192_backward; }
bool own_value_head_dim_enabled() { return overrides().own_value_head_dim; }
DecodeLoads decode_loads() { return overrides().decode_loads; }
std::optional<QueryTileGrid> forward_grid_override() { return overrides().forward_grid; }
bool end_aligned_rows_enabled() { return overrides().end_aligned_rows; }
bool skip_unseen_blocks_enabled() { return overrides().skip_unseen_blocks; }
bool vector_stores_enabled() { return overrides().vector_stores; }
bool staged_bias_enabled() { return overrides().bias_loads != BiasLoads::kDirect; }
bool tma_bias_enabled() { return overrides().bias_loads == BiasLoads::kTma; }

}  // namespace jax_flash::cuda
