// edgelin's TensorRT plugin: one decode step of a linear-attention layer through edgelin's own CUDA
// step kernel (edgelin_step_launch, edgelin/kernels/cuda/step.cu), as an IPluginV3 with the core,
// build (V2: input/output aliasing) and runtime capabilities, and an IPluginCreatorV3One.
//
// Loaded with no libnvinfer link: the library exports getCreators and setLoggerFinder (what
// IPluginRegistry::loadLibrary and trtexec --dynamicPlugins call) and nothing from nvinfer1 is
// referenced, so it loads into any TensorRT of the major its headers came from (one build per
// major: TensorRT 11 changed the logger interfaces' layout). Built with -Wl,--no-undefined.
//
// Tensors (all linear, contiguous; B dynamic):
//   inputs : q [B,H,K], k [B,H,K], v [B,H,V] (dtype), g [B,H,1|K] (aux_dtype, when gate != 0),
//            beta [B,H] (aux_dtype, when delta), e [B,H,K] (aux_dtype, when erase: Gated DeltaNet-2's
//            erase gate, delta rule only), state [B,H,K,V] float32
//   `erase` (launcher ABI 3) defaults to 0 and then adds no input: a node of an older graph keeps its
//   layout, so version "1" reads both.
//   outputs: o [B,H,V] (dtype), state_out [B,H,K,V] float32 (aliases `state` when inplace = 1)
#include <dlfcn.h>

#include <cstdio>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include <NvInferRuntime.h>
#include <NvInferVersion.h>

#include "edgelin_step.h"

#if defined(EDGELIN_TRT_MAJOR) && EDGELIN_TRT_MAJOR != NV_TENSORRT_MAJOR
#error "the TensorRT headers given are of another major version than the build asked for"
#endif
#if NV_TENSORRT_MAJOR < 10 || (NV_TENSORRT_MAJOR == 10 && NV_TENSORRT_MINOR < 3)
#error "edgelin's plugin needs TensorRT 10.3 or newer (IPluginV3OneBuildV2)"
#endif

// TENSORRTAPI is empty outside TensorRT's own build, so the exports say their visibility themselves
#define EDGELIN_EXPORT __attribute__((visibility("default")))
#define EDGELIN_STR2(x) #x
#define EDGELIN_STR(x) EDGELIN_STR2(x)

// Read from the file by edgelin.plugins.tensorrt.check_library, before anything is loaded or run.
extern "C" __attribute__((visibility("default"), used)) const char edgelin_trt_plugin_marker[] =
    "edgelin-trt-plugin:trt_major=" EDGELIN_STR(NV_TENSORRT_MAJOR) ";abi=" EDGELIN_STR(EDGELIN_STEP_ABI_VERSION) ";";

namespace {

using namespace nvinfer1;

constexpr char kName[] = "EdgelinStep";
constexpr char kVersion[] = "1";
constexpr char kNamespace[] = "";

// ---- logging through TensorRT's logger (set by setLoggerFinder), stderr before that ------------
std::mutex gLogMutex;
ILoggerFinder* gLoggerFinder = nullptr;

void logMessage(ILogger::Severity severity, std::string const& message) noexcept {
  try {
    std::string const line = std::string("edgelin plugin: ") + message;
    ILogger* logger = nullptr;
    {
      std::lock_guard<std::mutex> lock(gLogMutex);
      logger = gLoggerFinder != nullptr ? gLoggerFinder->findLogger() : nullptr;
    }
    if (logger != nullptr)
      logger->log(severity, line.c_str());
    else if (severity <= ILogger::Severity::kWARNING)
      std::fprintf(stderr, "%s\n", line.c_str());
  } catch (...) {
  }
}
void logError(std::string const& message) noexcept { logMessage(ILogger::Severity::kERROR, message); }

// ---- attributes ----------------------------------------------------------------------------------
struct Config {
  int32_t gate = EDGELIN_GATE_NONE;  // EdgelinGate
  int32_t delta = 0;                 // 1: delta rule (beta input)
  int32_t heads = 0, d_k = 0, d_v = 0;
  int32_t dtype = EDGELIN_F32;       // q, k, v, o
  int32_t aux_dtype = EDGELIN_F32;   // g, beta: float32 by default, or dtype
  int32_t inplace = 0;               // 1: state_out aliases the state input (preview feature)
  int32_t erase = 0;                 // 1: the erase gate input (needs delta)

  int32_t nbInputs() const { return 4 + (gate != EDGELIN_GATE_NONE ? 1 : 0) + (delta ? 1 : 0) + (erase ? 1 : 0); }
  int32_t gIndex() const { return gate != EDGELIN_GATE_NONE ? 3 : -1; }
  int32_t betaIndex() const { return delta ? 3 + (gate != EDGELIN_GATE_NONE ? 1 : 0) : -1; }
  int32_t eraseIndex() const { return erase ? stateIndex() - 1 : -1; }
  int32_t stateIndex() const { return nbInputs() - 1; }
  int32_t gWidth() const { return gate == EDGELIN_GATE_PER_KEY ? d_k : 1; }
};

struct FieldSpec {
  char const* name;
  int32_t Config::*member;
  int32_t lo, hi;
  bool required;
};
// Every attribute, its range and whether it has a default; serialisation writes all of them.
constexpr FieldSpec kFields[] = {
    {"gate", &Config::gate, 0, 2, false},       {"delta", &Config::delta, 0, 1, false},
    {"heads", &Config::heads, 1, 65535, true},  {"d_k", &Config::d_k, 1, EDGELIN_STEP_MAX_HEAD_DIM, true},
    {"d_v", &Config::d_v, 1, EDGELIN_STEP_MAX_HEAD_DIM, true},
    {"dtype", &Config::dtype, 0, 2, false},     {"aux_dtype", &Config::aux_dtype, 0, 2, false},
    {"inplace", &Config::inplace, 0, 1, false}, {"erase", &Config::erase, 0, 1, false},
};
constexpr int32_t kNbFields = static_cast<int32_t>(sizeof(kFields) / sizeof(kFields[0]));

// Parses and range-checks a field collection; on failure logs why and returns false.
bool parseConfig(PluginFieldCollection const* fc, Config& cfg) noexcept {
  if (fc == nullptr || (fc->nbFields > 0 && fc->fields == nullptr)) {
    logError("no attributes given (need heads, d_k, d_v)");
    return false;
  }
  bool seen[kNbFields] = {};
  for (int32_t i = 0; i < fc->nbFields; ++i) {
    PluginField const& f = fc->fields[i];
    int32_t which = -1;
    for (int32_t j = 0; j < kNbFields && f.name != nullptr; ++j)
      if (std::strcmp(f.name, kFields[j].name) == 0) which = j;
    if (which < 0) {
      logError(std::string("unknown attribute '") + (f.name ? f.name : "(null)") + "'");
      return false;
    }
    if (f.type != PluginFieldType::kINT32 || f.length != 1 || f.data == nullptr) {
      logError(std::string("attribute '") + f.name + "' must be one int32");
      return false;
    }
    int32_t value = 0;
    std::memcpy(&value, f.data, sizeof(value));
    FieldSpec const& spec = kFields[which];
    if (value < spec.lo || value > spec.hi) {
      logError(std::string("attribute '") + f.name + "' = " + std::to_string(value) + " is outside " +
               std::to_string(spec.lo) + ".." + std::to_string(spec.hi));
      return false;
    }
    cfg.*(spec.member) = value;
    seen[which] = true;
  }
  for (int32_t j = 0; j < kNbFields; ++j)
    if (kFields[j].required && !seen[j]) {
      logError(std::string("attribute '") + kFields[j].name + "' is required");
      return false;
    }
  if (cfg.aux_dtype != EDGELIN_F32 && cfg.aux_dtype != cfg.dtype) {
    logError("aux_dtype must be 0 (float32) or equal dtype (" + std::to_string(cfg.dtype) + "), got " +
             std::to_string(cfg.aux_dtype));
    return false;
  }
  if (cfg.erase && !cfg.delta) {
    logError("erase = 1 needs delta = 1 (the erase gate splits the delta rule's update)");
    return false;
  }
  return true;
}

DataType trtType(int32_t edgelinDtype) {
  return edgelinDtype == EDGELIN_F16 ? DataType::kHALF : edgelinDtype == EDGELIN_BF16 ? DataType::kBF16 : DataType::kFLOAT;
}

// ---- the plugin ---------------------------------------------------------------------------------
class StepPlugin final : public IPluginV3, public IPluginV3OneCore, public IPluginV3OneBuildV2, public IPluginV3OneRuntime {
 public:
  explicit StepPlugin(Config const& cfg) : mCfg(cfg) {}
  StepPlugin(StepPlugin const& other) : mCfg(other.mCfg) {}

  // IPluginV3
  IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept override {
    switch (type) {
      case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
      case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuildV2*>(this);
      case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
    }
    return nullptr;
  }
  IPluginV3* clone() noexcept override {
    try {
      return new StepPlugin(*this);
    } catch (...) {
      logError("clone: out of memory");
      return nullptr;
    }
  }

  // IPluginV3OneCore
  AsciiChar const* getPluginName() const noexcept override { return kName; }
  AsciiChar const* getPluginVersion() const noexcept override { return kVersion; }
  AsciiChar const* getPluginNamespace() const noexcept override { return kNamespace; }

  // IPluginV3OneBuild
  int32_t getNbOutputs() const noexcept override { return 2; }

  int32_t getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* /*inputTypes*/,
                             int32_t nbInputs) const noexcept override {
    if (outputTypes == nullptr || nbOutputs != 2 || nbInputs != mCfg.nbInputs()) return countError(nbInputs, nbOutputs);
    outputTypes[0] = trtType(mCfg.dtype);
    outputTypes[1] = DataType::kFLOAT;  // the state is float32 whatever the engine's precision
    return 0;
  }

  int32_t getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
                          int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs,
                          IExprBuilder& /*exprBuilder*/) noexcept override {
    if (inputs == nullptr || outputs == nullptr || nbInputs != mCfg.nbInputs() || nbOutputs != 2)
      return countError(nbInputs, nbOutputs);
    if (inputs[2].nbDims != 3 || inputs[mCfg.stateIndex()].nbDims != 4) {
      logError("v must be [B, H, d_v] and state [B, H, d_k, d_v]");
      return -1;
    }
    outputs[0] = inputs[2];                  // o: v's shape (the batch stays symbolic)
    outputs[1] = inputs[mCfg.stateIndex()];  // state_out: the state's
    return 0;
  }

  bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                 int32_t nbOutputs) noexcept override {
    if (inOut == nullptr || nbInputs != mCfg.nbInputs() || nbOutputs != 2 || pos < 0 || pos >= nbInputs + nbOutputs)
      return false;
    PluginTensorDesc const& d = inOut[pos].desc;
    return d.format == TensorFormat::kLINEAR && d.type == expectedType(pos);
  }

  int32_t configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const* out,
                          int32_t nbOutputs) noexcept override {
    if (in == nullptr || out == nullptr || nbInputs != mCfg.nbInputs() || nbOutputs != 2)
      return countError(nbInputs, nbOutputs);
    for (int32_t i = 0; i < nbInputs; ++i) {
      if (!checkDims(i, in[i].desc.dims, /*concrete=*/false) || !checkDims(i, in[i].min, true) ||
          !checkDims(i, in[i].max, true))
        return -1;
    }
    return 0;
  }

  // In place only when asked: TensorRT then hands the state input's buffer to state_out
  // (PreviewFeature::kALIASED_PLUGIN_IO_10_03 must be on in the builder config).
  int32_t getAliasedInput(int32_t outputIndex) noexcept override {
    return mCfg.inplace == 1 && outputIndex == 1 ? mCfg.stateIndex() : -1;
  }

  // IPluginV3OneRuntime
  int32_t onShapeChange(PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* out,
                        int32_t nbOutputs) noexcept override {
    if (in == nullptr || out == nullptr || nbInputs != mCfg.nbInputs() || nbOutputs != 2)
      return countError(nbInputs, nbOutputs);
    for (int32_t i = 0; i < nbInputs; ++i)
      if (!checkDims(i, in[i].dims, true)) return -1;
    return 0;
  }

  int32_t enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /*outputDesc*/, void const* const* inputs,
                  void* const* outputs, void* /*workspace*/, cudaStream_t stream) noexcept override {
    if (inputDesc == nullptr || inputs == nullptr || outputs == nullptr) return -1;
    int64_t const batch = inputDesc[0].dims.d[0];
    if (batch == 0) return 0;  // an empty batch: nothing to do
    if (batch < 0 || batch > 0x7fffffff) return -1;
    int64_t const H = mCfg.heads, K = mCfg.d_k, V = mCfg.d_v, W = mCfg.gWidth();
    EdgelinStepArgs a{};
    a.q = inputs[0], a.k = inputs[1], a.v = inputs[2], a.o = outputs[0];
    a.g = mCfg.gIndex() >= 0 ? inputs[mCfg.gIndex()] : nullptr;
    a.beta = mCfg.betaIndex() >= 0 ? inputs[mCfg.betaIndex()] : nullptr;
    a.erase = mCfg.eraseIndex() >= 0 ? inputs[mCfg.eraseIndex()] : nullptr;
    a.erase_flag = mCfg.erase, a.erase_stride_b = H * K, a.erase_stride_h = K;
    a.state_in = static_cast<float const*>(inputs[mCfg.stateIndex()]);
    a.state_out = static_cast<float*>(outputs[1]);
    a.batch = static_cast<int32_t>(batch), a.heads = mCfg.heads, a.d_k = mCfg.d_k, a.d_v = mCfg.d_v;
    a.q_stride_b = H * K, a.q_stride_h = K, a.k_stride_b = H * K, a.k_stride_h = K;
    a.v_stride_b = H * V, a.v_stride_h = V, a.o_stride_b = H * V, a.o_stride_h = V;
    a.g_stride_b = H * W, a.g_stride_h = W, a.beta_stride_b = H, a.beta_stride_h = 1;
    a.in_stride_b = a.out_stride_b = H * K * V, a.in_stride_h = a.out_stride_h = K * V;
    a.in_stride_k = a.out_stride_k = V;
    a.dtype = mCfg.dtype, a.aux_dtype = mCfg.aux_dtype, a.gate = mCfg.gate, a.delta = mCfg.delta;
    int const code = edgelin_step_launch(&a, stream);
    if (code == EDGELIN_OK) return 0;
    std::string why = edgelin_step_status_string(code);
    if (code == static_cast<int>(cudaErrorNoKernelImageForDevice))
      why += ": this library was not built for this GPU's compute capability; rebuild it with its architecture";
    logError("enqueue failed (" + std::to_string(code) + "): " + why);
    return code;
  }

  IPluginV3* attachToContext(IPluginResourceContext* /*context*/) noexcept override { return clone(); }

  PluginFieldCollection const* getFieldsToSerialize() noexcept override {
    mSerial.clear();
    for (FieldSpec const& spec : kFields) mSerial.emplace_back(spec.name, &(mCfg.*(spec.member)), PluginFieldType::kINT32, 1);
    mSerialCollection.nbFields = static_cast<int32_t>(mSerial.size());
    mSerialCollection.fields = mSerial.data();
    return &mSerialCollection;
  }

 private:
  int32_t countError(int32_t nbInputs, int32_t nbOutputs) const noexcept {
    logError("expected " + std::to_string(mCfg.nbInputs()) + " inputs and 2 outputs for this variant, got " +
             std::to_string(nbInputs) + " and " + std::to_string(nbOutputs));
    return -1;
  }

  DataType expectedType(int32_t pos) const {
    int32_t const nbIn = mCfg.nbInputs();
    if (pos == mCfg.stateIndex() || pos == nbIn + 1) return DataType::kFLOAT;
    if (pos == mCfg.gIndex() || pos == mCfg.betaIndex() || pos == mCfg.eraseIndex()) return trtType(mCfg.aux_dtype);
    return trtType(mCfg.dtype);  // q, k, v, o
  }

  // Checks an input's rank and its fixed extents against the attributes; a dynamic extent (-1) is
  // allowed only in the batch axis, and when `concrete` (min/max/runtime shapes) none is allowed.
  bool checkDims(int32_t index, Dims const& dims, bool concrete) const noexcept {
    static char const* const kRoles[] = {"q", "k", "v", "g", "beta", "state", "erase"};
    int32_t role = index < 3                  ? index
                   : index == mCfg.gIndex()     ? 3
                   : index == mCfg.betaIndex()  ? 4
                   : index == mCfg.eraseIndex() ? 6
                                                : 5;
    std::vector<int64_t> want;
    if (role <= 1 || role == 6) want = {mCfg.heads, mCfg.d_k};
    else if (role == 2) want = {mCfg.heads, mCfg.d_v};
    else if (role == 3) want = {mCfg.heads, mCfg.gWidth()};
    else if (role == 4) want = {mCfg.heads};
    else want = {mCfg.heads, mCfg.d_k, mCfg.d_v};
    std::string const name = kRoles[role];
    if (dims.nbDims != static_cast<int32_t>(want.size()) + 1) {
      logError("input '" + name + "' has rank " + std::to_string(dims.nbDims) + ", expected " +
               std::to_string(want.size() + 1));
      return false;
    }
    if (dims.d[0] < (concrete ? 0 : -1)) {
      logError("input '" + name + "' has batch " + std::to_string(dims.d[0]));
      return false;
    }
    for (size_t j = 0; j < want.size(); ++j)
      if (dims.d[j + 1] != want[j] && !(dims.d[j + 1] == -1 && !concrete)) {
        logError("input '" + name + "' axis " + std::to_string(j + 1) + " is " + std::to_string(dims.d[j + 1]) +
                 ", the attributes say " + std::to_string(want[j]));
        return false;
      }
    return true;
  }

  Config mCfg;
  std::vector<PluginField> mSerial;
  PluginFieldCollection mSerialCollection{};
};

// ---- the creator --------------------------------------------------------------------------------
class StepCreator final : public IPluginCreatorV3One {
 public:
  StepCreator() {
    for (FieldSpec const& spec : kFields) mNames.emplace_back(spec.name, nullptr, PluginFieldType::kINT32, 1);
    mNameCollection.nbFields = static_cast<int32_t>(mNames.size());
    mNameCollection.fields = mNames.data();
  }

  IPluginV3* createPlugin(AsciiChar const* name, PluginFieldCollection const* fc, TensorRTPhase /*phase*/) noexcept override {
    Config cfg;
    if (!parseConfig(fc, cfg)) {
      logError(std::string("cannot create '") + (name ? name : "(unnamed)") + "'; see the message above");
      return nullptr;
    }
    try {
      return new StepPlugin(cfg);
    } catch (...) {
      logError("createPlugin: out of memory");
      return nullptr;
    }
  }
  PluginFieldCollection const* getFieldNames() noexcept override { return &mNameCollection; }
  AsciiChar const* getPluginName() const noexcept override { return kName; }
  AsciiChar const* getPluginVersion() const noexcept override { return kVersion; }
  AsciiChar const* getPluginNamespace() const noexcept override { return kNamespace; }

 private:
  std::vector<PluginField> mNames;
  PluginFieldCollection mNameCollection{};
};

// Refuses to hand out creators when the linked launcher's ABI differs from the header's, or when
// the process runs a TensorRT of another major (found without linking libnvinfer).
bool compatible() noexcept {
  if (edgelin_step_abi_version() != EDGELIN_STEP_ABI_VERSION) {
    logError("launcher ABI " + std::to_string(edgelin_step_abi_version()) + " differs from the plugin's " +
             std::to_string(EDGELIN_STEP_ABI_VERSION) + "; rebuild the plugin (edgelin build)");
    return false;
  }
  using MajorFn = int32_t (*)();
  auto major = reinterpret_cast<MajorFn>(dlsym(RTLD_DEFAULT, "getInferLibMajorVersion"));
  if (major != nullptr && major() != NV_TENSORRT_MAJOR) {
    logError("built for TensorRT " + std::to_string(NV_TENSORRT_MAJOR) + ", loaded into TensorRT " +
             std::to_string(major()) + "; rebuild it against that TensorRT's headers (edgelin build)");
    return false;
  }
  for (int m = 8; m <= 12; ++m) {
    if (m == NV_TENSORRT_MAJOR) continue;
    std::string const lib = "libnvinfer.so." + std::to_string(m);
    if (void* h = dlopen(lib.c_str(), RTLD_NOW | RTLD_NOLOAD)) {
      dlclose(h);
      logError("built for TensorRT " + std::to_string(NV_TENSORRT_MAJOR) + " but " + lib +
               " is loaded; rebuild it against that TensorRT's headers (edgelin build)");
      return false;
    }
  }
  return true;
}

}  // namespace

extern "C" EDGELIN_EXPORT void setLoggerFinder(ILoggerFinder* finder) {
  std::lock_guard<std::mutex> lock(gLogMutex);
  gLoggerFinder = finder;
}

extern "C" EDGELIN_EXPORT IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
  nbCreators = 0;
  if (!compatible()) return nullptr;
  static StepCreator creator;
  static IPluginCreatorInterface* const creators[] = {&creator};
  nbCreators = 1;
  return creators;
}
