// Test harness for edgelin's TensorRT plugin library, with no TensorRT installed: it dlopens the
// built library, finds the creator through getCreators, and calls every method TensorRT would.
//
//   harness LIB              fields, output types/shapes, format combinations, configure with
//                            dynamic ranges, aliasing, serialise -> deserialise, clone, attach,
//                            out-of-range attributes (null + a logged error, no crash)
//   harness LIB --refusal    getCreators must hand out nothing (run with EDGELIN_FAKE_TRT_MAJOR set
//                            to another major: this executable then plays a TensorRT of that major)
//   harness LIB --gpu N      also enqueue every variant on the GPU for N steps and compare with a
//                            float64 CPU recurrence (fp32 / fp16 inputs, f32 / io-typed g and beta,
//                            in-place and ping-pong state, the erase gate of Gated DeltaNet-2)
// Prints "PASS ..." lines and ends with "HARNESS OK" (exit 0), or "FAIL ..." lines (exit 1).
#include <dlfcn.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <NvInferRuntime.h>
#include <NvInferVersion.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

using namespace nvinfer1;

static int gFailures = 0;
#define CHECK(cond, ...)                                \
  do {                                                  \
    if (!(cond)) {                                      \
      ++gFailures;                                      \
      std::printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::printf(__VA_ARGS__);                         \
      std::printf("\n");                                \
    }                                                   \
  } while (0)

// The plugin looks this up with dlsym(RTLD_DEFAULT) to refuse a TensorRT of another major; this
// executable (linked with -rdynamic) plays libnvinfer here.
extern "C" __attribute__((visibility("default"))) int32_t getInferLibMajorVersion() noexcept {
  char const* fake = std::getenv("EDGELIN_FAKE_TRT_MAJOR");
  return fake ? std::atoi(fake) : NV_TENSORRT_MAJOR;
}

// ---- test stand-ins for TensorRT's objects (logger, expression builder, resource context) -------
struct StandInLogger : ILogger {
  std::vector<std::string> errors, all;
  void log(Severity severity, AsciiChar const* msg) noexcept override {
    all.emplace_back(msg);
    if (severity <= Severity::kERROR) errors.emplace_back(msg);
  }
};
struct StandInLoggerFinder : ILoggerFinder {
  StandInLogger logger;
  ILogger* findLogger() override { return &logger; }
};

// TEST STAND-IN for the builder's symbolic dimensions: an expression is a constant or "unknown"
// (the dynamic batch); operations on an unknown stay unknown.
struct StandInExprImpl : apiv::VDimensionExpr {
  bool constant;
  int64_t value;
  StandInExprImpl(bool c, int64_t v) : constant(c), value(v) {}
  bool isConstant() const override { return constant; }
  int64_t getConstantValue() const override { return constant ? value : -1; }
  bool isSizeTensor() const override { return false; }
};
struct StandInExpr : IDimensionExpr {
  StandInExprImpl impl;
  StandInExpr(bool c, int64_t v) : impl(c, v) { mImpl = &impl; }
};
struct StandInExprBuilderImpl : apiv::VExprBuilder {
  std::vector<std::unique_ptr<StandInExpr>> pool;
  IDimensionExpr const* make(bool c, int64_t v) {
    pool.emplace_back(new StandInExpr(c, v));
    return pool.back().get();
  }
  IDimensionExpr const* constant(int64_t value) override { return make(true, value); }
  IDimensionExpr const* operation(DimensionOperation, IDimensionExpr const&, IDimensionExpr const&) override {
    return make(false, -1);
  }
  IDimensionExpr const* declareSizeTensor(int32_t, IDimensionExpr const&, IDimensionExpr const&) override {
    return make(false, -1);
  }
};
struct StandInExprBuilder : IExprBuilder {
  StandInExprBuilderImpl impl;
  StandInExprBuilder() { mImpl = &impl; }
};
struct StandInResourceContext : IPluginResourceContext {
  IGpuAllocator* getGpuAllocator() const noexcept override { return nullptr; }
  IErrorRecorder* getErrorRecorder() const noexcept override { return nullptr; }
};

// ---- variants ------------------------------------------------------------------------------------
struct Variant {
  int32_t gate, delta, heads, d_k, d_v, dtype, aux_dtype, inplace, erase = 0;
  int32_t nbInputs() const { return 4 + (gate ? 1 : 0) + (delta ? 1 : 0) + (erase ? 1 : 0); }
  int32_t gIndex() const { return gate ? 3 : -1; }
  int32_t betaIndex() const { return delta ? (gate ? 4 : 3) : -1; }
  int32_t eraseIndex() const { return erase ? stateIndex() - 1 : -1; }
  int32_t stateIndex() const { return nbInputs() - 1; }
  int32_t gWidth() const { return gate == 2 ? d_k : 1; }
  std::string label() const {
    char buf[160];
    std::snprintf(buf, sizeof buf, "gate=%d delta=%d H=%d K=%d V=%d dtype=%d aux=%d inplace=%d erase=%d", gate, delta,
                  heads, d_k, d_v, dtype, aux_dtype, inplace, erase);
    return buf;
  }
  // [B, ...] extents of input i, batch first
  std::vector<int64_t> inputDims(int32_t i, int64_t batch) const {
    if (i == 0 || i == 1 || i == eraseIndex()) return {batch, heads, d_k};
    if (i == 2) return {batch, heads, d_v};
    if (i == gIndex()) return {batch, heads, gWidth()};
    if (i == betaIndex()) return {batch, heads};
    return {batch, heads, d_k, d_v};
  }
};

static DataType trtType(int32_t d) { return d == 1 ? DataType::kHALF : d == 2 ? DataType::kBF16 : DataType::kFLOAT; }
static DataType inputType(Variant const& v, int32_t i) {
  if (i == v.stateIndex()) return DataType::kFLOAT;
  if (i == v.gIndex() || i == v.betaIndex() || i == v.eraseIndex()) return trtType(v.aux_dtype);
  return trtType(v.dtype);
}
static Dims makeDims(std::vector<int64_t> const& e) {
  Dims d{};
  d.nbDims = static_cast<int32_t>(e.size());
  for (size_t j = 0; j < e.size(); ++j) d.d[j] = e[j];
  return d;
}

struct Fields {
  std::vector<std::string> names;
  std::vector<int32_t> values;
  std::vector<PluginField> list;
  PluginFieldCollection fc{};
  void add(char const* name, int32_t value) { names.emplace_back(name), values.push_back(value); }
  PluginFieldCollection const* collection() {
    list.clear();
    for (size_t i = 0; i < names.size(); ++i)
      list.emplace_back(names[i].c_str(), &values[i], PluginFieldType::kINT32, 1);
    fc.nbFields = static_cast<int32_t>(list.size()), fc.fields = list.data();
    return &fc;
  }
};
static Fields fieldsOf(Variant const& v) {
  Fields f;
  f.add("gate", v.gate), f.add("delta", v.delta), f.add("heads", v.heads), f.add("d_k", v.d_k);
  f.add("d_v", v.d_v), f.add("dtype", v.dtype), f.add("aux_dtype", v.aux_dtype), f.add("inplace", v.inplace);
  f.add("erase", v.erase);
  return f;
}
static std::vector<std::pair<std::string, int32_t>> readFields(PluginFieldCollection const* fc) {
  std::vector<std::pair<std::string, int32_t>> out;
  for (int32_t i = 0; fc && i < fc->nbFields; ++i) {
    int32_t value = 0;
    if (fc->fields[i].type == PluginFieldType::kINT32 && fc->fields[i].length == 1 && fc->fields[i].data)
      std::memcpy(&value, fc->fields[i].data, 4);
    out.emplace_back(fc->fields[i].name, value);
  }
  return out;
}

template <typename T>
static T* capability(IPluginV3* p, PluginCapabilityType type) {
  return static_cast<T*>(p->getCapabilityInterface(type));
}

// ---- the build/runtime walk a TensorRT builder and runtime would make -----------------------------
static void checkVariant(IPluginCreatorV3One* creator, Variant const& v) {
  std::string const label = v.label();
  Fields fields = fieldsOf(v);
  std::unique_ptr<IPluginV3> plugin(creator->createPlugin("step", fields.collection(), TensorRTPhase::kBUILD));
  CHECK(plugin != nullptr, "%s: createPlugin", label.c_str());
  if (!plugin) return;
  auto* core = capability<IPluginV3OneCore>(plugin.get(), PluginCapabilityType::kCORE);
  auto* build = capability<IPluginV3OneBuildV2>(plugin.get(), PluginCapabilityType::kBUILD);
  auto* runtime = capability<IPluginV3OneRuntime>(plugin.get(), PluginCapabilityType::kRUNTIME);
  CHECK(core && build && runtime, "%s: capabilities", label.c_str());
  if (!core || !build || !runtime) return;
  CHECK(std::strcmp(core->getPluginName(), "EdgelinStep") == 0 && std::strcmp(core->getPluginVersion(), "1") == 0,
        "%s: name/version", label.c_str());
  CHECK(std::strcmp(build->getInterfaceInfo().kind, "PLUGIN_V3ONE_BUILD") == 0 && build->getInterfaceInfo().major == 2,
        "%s: the build capability is V2", label.c_str());
  int32_t const nbIn = v.nbInputs();
  CHECK(build->getNbOutputs() == 2, "%s: nb outputs", label.c_str());

  std::vector<DataType> inTypes(nbIn);
  for (int32_t i = 0; i < nbIn; ++i) inTypes[i] = inputType(v, i);
  DataType outTypes[2] = {DataType::kINT8, DataType::kINT8};
  CHECK(build->getOutputDataTypes(outTypes, 2, inTypes.data(), nbIn) == 0, "%s: output types", label.c_str());
  CHECK(outTypes[0] == trtType(v.dtype) && outTypes[1] == DataType::kFLOAT, "%s: o is io-typed, state fp32", label.c_str());
  CHECK(build->getOutputDataTypes(outTypes, 2, inTypes.data(), nbIn - 1) != 0, "%s: wrong input count refused", label.c_str());

  // symbolic shapes: batch unknown, the rest constants
  StandInExprBuilder exprs;
  std::vector<DimsExprs> inExprs(nbIn);
  for (int32_t i = 0; i < nbIn; ++i) {
    auto e = v.inputDims(i, -1);
    inExprs[i].nbDims = static_cast<int32_t>(e.size());
    inExprs[i].d[0] = exprs.impl.make(false, -1);
    for (size_t j = 1; j < e.size(); ++j) inExprs[i].d[j] = exprs.constant(e[j]);
  }
  DimsExprs outExprs[2]{};
  CHECK(build->getOutputShapes(inExprs.data(), nbIn, nullptr, 0, outExprs, 2, exprs) == 0, "%s: output shapes", label.c_str());
  CHECK(outExprs[0].nbDims == 3 && !outExprs[0].d[0]->isConstant() && outExprs[0].d[1]->getConstantValue() == v.heads &&
            outExprs[0].d[2]->getConstantValue() == v.d_v,
        "%s: o is [B, H, d_v]", label.c_str());
  CHECK(outExprs[1].nbDims == 4 && !outExprs[1].d[0]->isConstant() && outExprs[1].d[2]->getConstantValue() == v.d_k &&
            outExprs[1].d[3]->getConstantValue() == v.d_v,
        "%s: state_out is [B, H, d_k, d_v]", label.c_str());

  // format combinations: exactly the declared type in linear format, at every position
  std::vector<DynamicPluginTensorDesc> io(nbIn + 2);
  auto fill = [&](int64_t batch, int64_t lo, int64_t hi) {
    for (int32_t i = 0; i < nbIn + 2; ++i) {
      int32_t const src = i < nbIn ? i : (i == nbIn ? 2 : v.stateIndex());
      DataType const t = i < nbIn ? inputType(v, i) : (i == nbIn ? trtType(v.dtype) : DataType::kFLOAT);
      io[i].desc.dims = makeDims(v.inputDims(src, batch));
      io[i].min = makeDims(v.inputDims(src, lo));
      io[i].max = makeDims(v.inputDims(src, hi));
      io[i].opt = makeDims(v.inputDims(src, hi));
      io[i].desc.type = t;
      io[i].desc.format = TensorFormat::kLINEAR;
    }
  };
  fill(-1, 1, 8);
  for (int32_t pos = 0; pos < nbIn + 2; ++pos) {
    CHECK(build->supportsFormatCombination(pos, io.data(), nbIn, 2), "%s: pos %d declared type", label.c_str(), pos);
    DataType const keep = io[pos].desc.type;
    for (DataType other : {DataType::kFLOAT, DataType::kHALF, DataType::kBF16, DataType::kINT8}) {
      if (other == keep) continue;
      io[pos].desc.type = other;
      CHECK(!build->supportsFormatCombination(pos, io.data(), nbIn, 2), "%s: pos %d type %d refused", label.c_str(), pos,
            static_cast<int>(other));
    }
    io[pos].desc.type = keep;
    io[pos].desc.format = TensorFormat::kCHW32;
    CHECK(!build->supportsFormatCombination(pos, io.data(), nbIn, 2), "%s: pos %d non-linear refused", label.c_str(), pos);
    io[pos].desc.format = TensorFormat::kLINEAR;
  }
  CHECK(!build->supportsFormatCombination(nbIn + 2, io.data(), nbIn, 2), "%s: position out of range", label.c_str());

  // configure with a dynamic batch 1..8; a wrong head count is refused
  CHECK(build->configurePlugin(io.data(), nbIn, io.data() + nbIn, 2) == 0, "%s: configure dynamic", label.c_str());
  io[2].desc.dims.d[1] = v.heads + 1;
  CHECK(build->configurePlugin(io.data(), nbIn, io.data() + nbIn, 2) != 0, "%s: wrong heads refused", label.c_str());
  io[2].desc.dims.d[1] = v.heads;
  CHECK(build->getWorkspaceSize(io.data(), nbIn, io.data() + nbIn, 2) == 0, "%s: workspace", label.c_str());
  CHECK(build->getAliasedInput(0) == -1, "%s: o never aliased", label.c_str());
  CHECK(build->getAliasedInput(1) == (v.inplace ? v.stateIndex() : -1), "%s: state aliasing", label.c_str());

  // serialise -> deserialise (runtime phase) -> the same fields; clone; attach
  auto const want = readFields(fields.collection());
  auto const serial = readFields(runtime->getFieldsToSerialize());
  CHECK(serial == want, "%s: serialised fields", label.c_str());
  std::vector<std::pair<std::string, int32_t>> copy = serial;
  Fields back;
  for (auto& kv : copy) back.add(kv.first.c_str(), kv.second);
  std::unique_ptr<IPluginV3> restored(creator->createPlugin("step", back.collection(), TensorRTPhase::kRUNTIME));
  CHECK(restored != nullptr, "%s: deserialise", label.c_str());
  if (restored) {
    auto* rt = capability<IPluginV3OneRuntime>(restored.get(), PluginCapabilityType::kRUNTIME);
    CHECK(readFields(rt->getFieldsToSerialize()) == want, "%s: round trip", label.c_str());
  }
  std::unique_ptr<IPluginV3> cloned(plugin->clone());
  CHECK(cloned && readFields(capability<IPluginV3OneRuntime>(cloned.get(), PluginCapabilityType::kRUNTIME)
                                 ->getFieldsToSerialize()) == want,
        "%s: clone", label.c_str());
  StandInResourceContext context;
  std::unique_ptr<IPluginV3> attached(runtime->attachToContext(&context));
  CHECK(attached && attached.get() != plugin.get() &&
            readFields(capability<IPluginV3OneRuntime>(attached.get(), PluginCapabilityType::kRUNTIME)
                           ->getFieldsToSerialize()) == want,
        "%s: attach", label.c_str());

  // runtime shapes: concrete batch 3 accepted, a dynamic extent at runtime refused
  std::vector<PluginTensorDesc> in(nbIn), out(2);
  for (int32_t i = 0; i < nbIn; ++i) in[i] = io[i].desc, in[i].dims = makeDims(v.inputDims(i, 3));
  out[0] = io[nbIn].desc, out[1] = io[nbIn + 1].desc;
  CHECK(runtime->onShapeChange(in.data(), nbIn, out.data(), 2) == 0, "%s: onShapeChange", label.c_str());
  in[0].dims.d[0] = -1;
  CHECK(runtime->onShapeChange(in.data(), nbIn, out.data(), 2) != 0, "%s: runtime -1 refused", label.c_str());
}

// ---- attribute values out of range: the creator logs and returns null --------------------------
static void checkBadAttributes(IPluginCreatorV3One* creator, StandInLogger& logger) {
  Variant const good{1, 1, 4, 64, 64, 1, 0, 0};
  struct Bad {
    char const* field;
    int32_t value;
  };
  for (Bad bad : {Bad{"gate", 3}, Bad{"gate", -1}, Bad{"delta", 2}, Bad{"heads", 0}, Bad{"d_k", 257}, Bad{"d_k", 0},
                  Bad{"d_v", 1000}, Bad{"dtype", 3}, Bad{"aux_dtype", 2}, Bad{"inplace", 5}, Bad{"erase", 2},
                  Bad{"bogus", 1}}) {
    Fields f = fieldsOf(good);
    bool replaced = false;
    for (size_t i = 0; i < f.names.size(); ++i)
      if (f.names[i] == bad.field) f.values[i] = bad.value, replaced = true;
    if (!replaced) f.add(bad.field, bad.value);
    size_t const before = logger.errors.size();
    IPluginV3* p = creator->createPlugin("bad", f.collection(), TensorRTPhase::kBUILD);
    CHECK(p == nullptr, "%s=%d accepted", bad.field, bad.value);
    delete p;
    bool named = false;
    for (size_t i = before; i < logger.errors.size(); ++i) named = named || logger.errors[i].find(bad.field) != std::string::npos;
    CHECK(named, "%s=%d: no logged error naming the attribute", bad.field, bad.value);
  }
  // a required attribute missing, a wrongly typed one, and no collection at all
  Fields missing;
  missing.add("heads", 4), missing.add("d_k", 64);
  CHECK(creator->createPlugin("bad", missing.collection(), TensorRTPhase::kBUILD) == nullptr, "d_v missing accepted");
  Fields noDelta = fieldsOf(Variant{1, 0, 4, 64, 64, 0, 0, 0, 1});  // the erase gate needs the delta rule
  CHECK(creator->createPlugin("bad", noDelta.collection(), TensorRTPhase::kBUILD) == nullptr,
        "erase=1 with delta=0 accepted");
  // an older graph's node (no erase field at all): the same plugin as erase=0
  Fields old = fieldsOf(good);
  old.names.pop_back(), old.values.pop_back();
  std::unique_ptr<IPluginV3> oldPlugin(creator->createPlugin("old", old.collection(), TensorRTPhase::kBUILD));
  CHECK(oldPlugin != nullptr, "a node without the erase field refused");
  Fields typed = fieldsOf(good);
  typed.collection();
  float f32 = 1.f;
  typed.list[0] = PluginField("gate", &f32, PluginFieldType::kFLOAT32, 1);
  CHECK(creator->createPlugin("bad", &typed.fc, TensorRTPhase::kBUILD) == nullptr, "float gate accepted");
  CHECK(creator->createPlugin("bad", nullptr, TensorRTPhase::kBUILD) == nullptr, "null collection accepted");
  std::printf("PASS out-of-range attributes: null and a logged error each (%zu errors)\n", logger.errors.size());
}

// ---- GPU: enqueue against a float64 recurrence ---------------------------------------------------
static float roundTo(int32_t dtype, float x) { return dtype == 1 ? __half2float(__float2half(x)) : x; }

static void packInto(std::vector<unsigned char>& dst, std::vector<float> const& src, int32_t dtype) {
  dst.resize(src.size() * (dtype == 0 ? 4 : 2));
  for (size_t i = 0; i < src.size(); ++i) {
    if (dtype == 0) std::memcpy(&dst[i * 4], &src[i], 4);
    else {
      __half h = __float2half(src[i]);
      std::memcpy(&dst[i * 2], &h, 2);
    }
  }
}

#define CUDA_OK(x)                                                \
  do {                                                            \
    cudaError_t const e_ = (x);                                   \
    CHECK(e_ == cudaSuccess, "%s", cudaGetErrorString(e_));       \
  } while (0)

static void gpuVariant(IPluginCreatorV3One* creator, Variant const& v, int steps, double tolO, double tolS) {
  int64_t const B = 3, H = v.heads, K = v.d_k, V = v.d_v, W = v.gWidth();
  Fields fields = fieldsOf(v);
  std::unique_ptr<IPluginV3> plugin(creator->createPlugin("step", fields.collection(), TensorRTPhase::kRUNTIME));
  CHECK(plugin != nullptr, "%s: create", v.label().c_str());
  if (!plugin) return;
  auto* rt = capability<IPluginV3OneRuntime>(plugin.get(), PluginCapabilityType::kRUNTIME);
  int32_t const nbIn = v.nbInputs();
  std::vector<PluginTensorDesc> inDesc(nbIn), outDesc(2);
  for (int32_t i = 0; i < nbIn; ++i) {
    inDesc[i].dims = makeDims(v.inputDims(i, B)), inDesc[i].type = inputType(v, i), inDesc[i].format = TensorFormat::kLINEAR;
  }
  outDesc[0].dims = makeDims({B, H, V}), outDesc[0].type = trtType(v.dtype);
  outDesc[1].dims = makeDims({B, H, K, V}), outDesc[1].type = DataType::kFLOAT;
  CHECK(rt->onShapeChange(inDesc.data(), nbIn, outDesc.data(), 2) == 0, "%s: shape", v.label().c_str());

  std::mt19937 rng(1234 + v.gate * 7 + v.delta * 3 + v.dtype + v.erase * 11);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> uniform(0.f, 1.f);
  size_t const nQ = B * H * K, nV = B * H * V, nG = B * H * W, nB = B * H, nS = B * H * K * V;
  std::vector<double> S(nS);
  std::vector<float> s0(nS);
  for (size_t i = 0; i < nS; ++i) s0[i] = 0.1f * normal(rng), S[i] = s0[i];
  size_t const ioBytes = v.dtype == 0 ? 4 : 2, auxBytes = v.aux_dtype == 0 ? 4 : 2;
  void *dq, *dk, *dv, *dg = nullptr, *dbeta = nullptr, *de = nullptr, *dO;
  float *dS0, *dS1;
  CUDA_OK(cudaMalloc(&dq, nQ * ioBytes));
  CUDA_OK(cudaMalloc(&dk, nQ * ioBytes));
  CUDA_OK(cudaMalloc(&dv, nV * ioBytes));
  CUDA_OK(cudaMalloc(&dO, nV * ioBytes));
  if (v.gate) CUDA_OK(cudaMalloc(&dg, nG * auxBytes));
  if (v.delta) CUDA_OK(cudaMalloc(&dbeta, nB * auxBytes));
  if (v.erase) CUDA_OK(cudaMalloc(&de, nQ * auxBytes));
  CUDA_OK(cudaMalloc(&dS0, nS * 4));
  CUDA_OK(cudaMalloc(&dS1, nS * 4));
  CUDA_OK(cudaMemcpy(dS0, s0.data(), nS * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(dS1, 0xff, nS * 4));  // NaN: an unwritten element shows
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));

  double errO = 0, refO = 0;
  std::vector<float> q(nQ), k(nQ), vv(nV), g(nG), beta(nB), e(nQ, 1.f), o(nV);
  std::vector<unsigned char> bq, bk, bv, bg, bb, be, bo(nV * ioBytes);
  float* cur = dS0;
  float* nxt = v.inplace ? dS0 : dS1;
  for (int t = 0; t < steps; ++t) {
    for (size_t i = 0; i < nQ; ++i) q[i] = roundTo(v.dtype, normal(rng) / std::sqrt(float(K)));
    for (size_t i = 0; i < nQ; ++i) k[i] = normal(rng);
    for (int64_t bh = 0; bh < B * H; ++bh) {  // unit keys keep the delta rule stable
      double n = 0;
      for (int64_t j = 0; j < K; ++j) n += double(k[bh * K + j]) * k[bh * K + j];
      for (int64_t j = 0; j < K; ++j) k[bh * K + j] = roundTo(v.dtype, float(k[bh * K + j] / std::sqrt(n)));
    }
    for (size_t i = 0; i < nV; ++i) vv[i] = roundTo(v.dtype, normal(rng));
    for (size_t i = 0; i < nG; ++i) g[i] = roundTo(v.aux_dtype, -std::log1p(std::exp(-(normal(rng) + 3.f))));
    for (size_t i = 0; i < nB; ++i) beta[i] = roundTo(v.aux_dtype, uniform(rng));
    if (v.erase)
      for (size_t i = 0; i < nQ; ++i) e[i] = roundTo(v.aux_dtype, uniform(rng));
    packInto(bq, q, v.dtype), packInto(bk, k, v.dtype), packInto(bv, vv, v.dtype);
    CUDA_OK(cudaMemcpyAsync(dq, bq.data(), bq.size(), cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaMemcpyAsync(dk, bk.data(), bk.size(), cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaMemcpyAsync(dv, bv.data(), bv.size(), cudaMemcpyHostToDevice, stream));
    if (v.gate) {
      packInto(bg, g, v.aux_dtype);
      CUDA_OK(cudaMemcpyAsync(dg, bg.data(), bg.size(), cudaMemcpyHostToDevice, stream));
    }
    if (v.delta) {
      packInto(bb, beta, v.aux_dtype);
      CUDA_OK(cudaMemcpyAsync(dbeta, bb.data(), bb.size(), cudaMemcpyHostToDevice, stream));
    }
    if (v.erase) {
      packInto(be, e, v.aux_dtype);
      CUDA_OK(cudaMemcpyAsync(de, be.data(), be.size(), cudaMemcpyHostToDevice, stream));
    }
    std::vector<void const*> ins(nbIn);
    ins[0] = dq, ins[1] = dk, ins[2] = dv, ins[v.stateIndex()] = cur;
    if (v.gate) ins[v.gIndex()] = dg;
    if (v.delta) ins[v.betaIndex()] = dbeta;
    if (v.erase) ins[v.eraseIndex()] = de;
    void* outs[2] = {dO, nxt};
    int const rc = rt->enqueue(inDesc.data(), outDesc.data(), ins.data(), outs, nullptr, stream);
    CHECK(rc == 0, "%s: enqueue step %d returned %d", v.label().c_str(), t, rc);
    CUDA_OK(cudaMemcpyAsync(bo.data(), dO, bo.size(), cudaMemcpyDeviceToHost, stream));
    // the float64 reference step on the same (rounded) inputs, while the GPU runs
    for (int64_t bh = 0; bh < B * H; ++bh) {
      double* s = &S[bh * K * V];
      for (int64_t i = 0; i < K; ++i) {
        double const decay = v.gate == 0 ? 1.0 : std::exp(double(g[bh * W + (v.gate == 2 ? i : 0)]));
        for (int64_t j = 0; j < V; ++j) s[i * V + j] *= decay;
      }
      std::vector<double> u(V), p(V);
      for (int64_t j = 0; j < V; ++j) {
        double sk = 0;
        if (v.delta)
          for (int64_t i = 0; i < K; ++i) sk += s[i * V + j] * k[bh * K + i];
        p[j] = sk;
        u[j] = v.delta ? beta[bh] * (vv[bh * V + j] - (v.erase ? 0.0 : sk)) : vv[bh * V + j];
      }
      // the erase gate: S -= beta (e * k) p^T, then S += k (beta v)^T
      for (int64_t i = 0; i < K; ++i)
        for (int64_t j = 0; j < V; ++j)
          s[i * V + j] += double(k[bh * K + i]) * u[j] -
                          (v.erase ? double(beta[bh]) * e[bh * K + i] * k[bh * K + i] * p[j] : 0.0);
      for (int64_t j = 0; j < V; ++j) {
        double ref = 0;
        for (int64_t i = 0; i < K; ++i) ref += s[i * V + j] * q[bh * K + i];
        o[bh * V + j] = static_cast<float>(ref);
      }
    }
    CUDA_OK(cudaStreamSynchronize(stream));
    for (size_t i = 0; i < nV; ++i) {
      float got;
      if (v.dtype == 0) std::memcpy(&got, &bo[i * 4], 4);
      else {
        __half h;
        std::memcpy(&h, &bo[i * 2], 2);
        got = __half2float(h);
      }
      if (!std::isfinite(got)) got = 1e30f;
      errO += (double(got) - o[i]) * (double(got) - o[i]), refO += double(o[i]) * o[i];
    }
    if (!v.inplace) std::swap(cur, nxt);
  }
  std::vector<float> sGot(nS);
  CUDA_OK(cudaMemcpy(sGot.data(), cur, nS * 4, cudaMemcpyDeviceToHost));
  double errS = 0, refS = 0;
  for (size_t i = 0; i < nS; ++i) {
    double const d = std::isfinite(sGot[i]) ? sGot[i] - S[i] : 1e30;
    errS += d * d, refS += S[i] * S[i];
  }
  double const relO = std::sqrt(errO / refO), relS = std::sqrt(errS / refS);
  CHECK(relO < tolO && relS < tolS, "%s: %d steps rel err o %.3g (tol %.1g) state %.3g (tol %.1g)", v.label().c_str(),
        steps, relO, tolO, relS, tolS);
  std::printf("PASS gpu %s steps=%d rel_o=%.3g rel_state=%.3g\n", v.label().c_str(), steps, relO, relS);
  cudaFree(dq), cudaFree(dk), cudaFree(dv), cudaFree(dO), cudaFree(dg), cudaFree(dbeta), cudaFree(de), cudaFree(dS0),
      cudaFree(dS1);
  cudaStreamDestroy(stream);
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: harness LIB [--refusal | --gpu STEPS]\n");
    return 2;
  }
  bool const refusal = argc > 2 && std::strcmp(argv[2], "--refusal") == 0;
  int const gpuSteps = argc > 3 && std::strcmp(argv[2], "--gpu") == 0 ? std::atoi(argv[3]) : 0;
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    std::printf("FAIL dlopen: %s\n", dlerror());
    return 1;
  }
  using GetCreators = IPluginCreatorInterface* const* (*)(int32_t&);
  using SetLoggerFinder = void (*)(ILoggerFinder*);
  auto getCreators = reinterpret_cast<GetCreators>(dlsym(lib, "getCreators"));
  auto setLoggerFinder = reinterpret_cast<SetLoggerFinder>(dlsym(lib, "setLoggerFinder"));
  auto marker = static_cast<char const*>(dlsym(lib, "edgelin_trt_plugin_marker"));
  CHECK(getCreators && setLoggerFinder && marker, "exports");
  if (!getCreators || !setLoggerFinder) return 1;
  static StandInLoggerFinder finder;
  setLoggerFinder(&finder);
  std::printf("marker: %s\n", marker);

  int32_t nb = -1;
  IPluginCreatorInterface* const* creators = getCreators(nb);
  if (refusal) {
    CHECK(nb == 0, "a TensorRT of another major got %d creators", nb);
    CHECK(!finder.logger.errors.empty() && finder.logger.errors.back().find("built for TensorRT") != std::string::npos,
          "no logged refusal");
    if (!finder.logger.errors.empty()) std::printf("refused: %s\n", finder.logger.errors.back().c_str());
    std::printf(gFailures ? "HARNESS FAILED\n" : "HARNESS OK\n");
    return gFailures ? 1 : 0;
  }
  CHECK(nb == 1 && creators && creators[0], "one creator, got %d", nb);
  if (nb != 1) return 1;
  CHECK(std::strcmp(creators[0]->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") == 0, "creator kind %s",
        creators[0]->getInterfaceInfo().kind);
  auto* creator = static_cast<IPluginCreatorV3One*>(creators[0]);
  CHECK(std::strcmp(creator->getPluginName(), "EdgelinStep") == 0, "creator name");
  auto names = readFields(creator->getFieldNames());
  std::string joined;
  for (auto& kv : names) joined += kv.first + ",";
  CHECK(joined == "gate,delta,heads,d_k,d_v,dtype,aux_dtype,inplace,erase,", "field names %s", joined.c_str());

  int variants = 0;
  for (int32_t gate = 0; gate <= 2; ++gate)
    for (int32_t delta = 0; delta <= 1; ++delta)
      for (int32_t dtype = 0; dtype <= 2; ++dtype)
        for (int32_t own = 0; own <= (dtype ? 1 : 0); ++own)  // g/beta in float32, or in dtype
          for (int32_t inplace = 0; inplace <= 1; ++inplace) {
            checkVariant(creator, Variant{gate, delta, 4, 64, 48, dtype, own ? dtype : 0, inplace});
            ++variants;
          }
  for (int32_t gate = 0; gate <= 2; ++gate)  // Gated DeltaNet-2: the erase gate (delta rule only)
    for (int32_t dtype = 0; dtype <= 2; ++dtype)
      for (int32_t own = 0; own <= (dtype ? 1 : 0); ++own)
        checkVariant(creator, Variant{gate, 1, 4, 64, 48, dtype, own ? dtype : 0, gate == 1, 1}), ++variants;
  checkVariant(creator, Variant{2, 1, 1, 256, 256, 1, 0, 1}), ++variants;
  checkVariant(creator, Variant{1, 0, 7, 1, 1, 0, 0, 0}), ++variants;
  std::printf("PASS build/runtime walk over %d variants\n", variants);
  checkBadAttributes(creator, finder.logger);

  if (gpuSteps > 0) {
    for (int32_t gate = 0; gate <= 2; ++gate)
      for (int32_t delta = 0; delta <= 1; ++delta)
        for (int32_t dtype : {0, 1})
          for (int32_t own = 0; own <= (dtype ? 1 : 0); ++own)
            for (int32_t inplace = 0; inplace <= 1; ++inplace) {
              double const tolO = dtype == 0 ? 1e-4 : 3e-3, tolS = 1e-4;
              gpuVariant(creator, Variant{gate, delta, 4, 64, 48, dtype, own ? dtype : 0, inplace}, gpuSteps, tolO, tolS);
            }
    gpuVariant(creator, Variant{2, 1, 2, 128, 128, 1, 0, 1}, gpuSteps, 3e-3, 1e-4);
    for (int32_t gate = 0; gate <= 2; ++gate)  // Gated DeltaNet-2's erase gate
      for (int32_t dtype : {0, 1})
        for (int32_t inplace = 0; inplace <= 1; ++inplace) {
          double const tolO = dtype == 0 ? 1e-4 : 3e-3, tolS = 1e-4;
          gpuVariant(creator, Variant{gate, 1, 4, 64, 48, dtype, 0, inplace, 1}, gpuSteps, tolO, tolS);
        }
    gpuVariant(creator, Variant{1, 1, 2, 128, 128, 1, 1, 1, 1}, gpuSteps, 3e-3, 1e-4);  // fp16 g/beta/e
    gpuVariant(creator, Variant{1, 1, 2, 256, 256, 0, 0, 0, 1}, gpuSteps, 1e-4, 1e-4);  // the wide tile
  }
  std::printf(gFailures ? "HARNESS FAILED (%d failures)\n" : "HARNESS OK\n", gFailures);
  return gFailures ? 1 : 0;
}
